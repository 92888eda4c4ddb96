"""The engine's outbox: a pass's events reach the event loop in one hand-over, in order
(a real asyncio loop, events added from another thread as the engine thread does)."""

import asyncio
import threading

from omlx_core.serve.request import Delta, Finished, Outbox, Request, Started


def drain(request: Request) -> list:
    events = []
    while not request.events.empty():
        events.append(request.events.get_nowait())
    return events


def test_a_pass_reaches_the_loop_in_one_call_and_in_order():
    loop = asyncio.new_event_loop()
    try:
        hand_overs = []
        real = loop.call_soon_threadsafe

        def counted(callback, *args):
            hand_overs.append(callback)
            return real(callback, *args)

        loop.call_soon_threadsafe = counted
        first, second = (Request(model_id="m", prompt=[1], max_tokens=4, loop=loop) for _ in range(2))
        outbox = Outbox()
        events = [(first, Started(0)), (second, Started(0)), (first, Delta("a", 1)), (second, Delta("b", 1)),
                  (first, Delta("c", 2)), (first, Finished("length", 1, 2))]

        def engine_pass():
            for request, event in events:
                outbox.add(request, event)

        worker = threading.Thread(target=engine_pass)
        worker.start()
        worker.join()
        loop.run_until_complete(asyncio.sleep(0))
        assert drain(first) == [] and drain(second) == []  # nothing before the flush
        worker = threading.Thread(target=outbox.flush)
        worker.start()
        worker.join()
        loop.run_until_complete(asyncio.sleep(0.01))
        assert len(hand_overs) == 1
        assert drain(first) == [e for r, e in events if r is first]
        assert drain(second) == [e for r, e in events if r is second]
        outbox.flush()  # an empty pass hands nothing over
        assert len(hand_overs) == 1
    finally:
        loop.close()


def test_a_request_without_a_loop_gets_its_events_at_once():
    request = Request(model_id="m", prompt=[1], max_tokens=1)
    Outbox().add(request, Delta("x", 1))
    assert drain(request) == [Delta("x", 1)]
