"""The engine: one thread that owns every MLX call and steps each model's batch.

HTTP handlers never touch MLX. They hand the engine a `Request` (through the scheduler)
and read its events; anything else that needs the engine thread (loading a model to
tokenize against it) goes through `call`, which runs a function there and returns a
future. Per step the engine admits what the scheduler lets through, advances every
model's generator (`batch_generator.JoiningBatchGenerator`: mlx-lm's `BatchGenerator`
with finished prompts joining the running batch's step) by one step, turns tokens into text per request
(its own detokenizer, stop strings, EOS), and removes cancelled requests at once, so a
client that goes away frees its slot and its KV on the next step. The step's events go
to the HTTP side in one hand-over (`Outbox`).

Prefix reuse: a request starts from the longest prefix its model's tiered prompt cache
holds (`prompt_cache/`) and prefills only the rest. Its prompt is inserted in two
segments split at the last whole block, so mlx-lm's generator stops there and the engine
extracts the cache at that boundary and stores its blocks (with the state snapshot that
hybrid and sliding-window layers need). The memory tier is charged to the memory guard
as an extra and is the first thing dropped when the guard needs room; SSD entries stay.
"""

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

from omlx_core.memory.guard import MemoryRefused
from omlx_core.memory.kv import estimate_kv_bytes, worst_case_kv_bytes
from omlx_core.serve.prefill_batching import PrefillBatching
from omlx_core.serve.request import Delta, Finished, Outbox, Request, Started
from omlx_core.serve.sampling import StopText, make_sampler

log = logging.getLogger("omlx.serve")

IDLE_WAIT_S = 0.05
STATS_EVERY_STEPS = 16
SLOW_STEP_S = 0.25  # a step this long holds every stream: logged (at info) with its shape


WARMUP_PROMPT = [1, 2]  # token ids every vocabulary has
WARMUP_TOKENS = 3  # decode steps of each warm-up sequence


def prefill_tokens(settings, backend: str | None = None) -> int:
    """server.prefill_tokens, its 0 (auto) resolved: twice prefill.chunk_size on CUDA, where
    32 streams measured 1.12-1.19x the tokens a second (prefill_batching's docstring), and
    prefill.chunk_size on other backends, which keep the budget they were measured with."""
    tokens = int(settings["server.prefill_tokens"])
    if tokens:
        return tokens
    from omlx_core.hardware import mlx_backend

    chunk = int(settings["prefill.chunk_size"])
    return 2 * chunk if (backend or mlx_backend()) == "cuda" else chunk


def warm_up(generator, max_running: int) -> set[int]:
    """Decode a short dummy batch of one sequence, of each size at which the decode
    kernels change launch shape (2, 9, 17, 33 sequences with qmm_decode installed), and of
    `max_running`, through the server's own generator before the first request: a decode
    step's kernels are compiled (and CUDA graphs made) the first time each batch size
    runs, and on the H200 that made the first 32 requests of a cold server wait seconds
    for their first token (670 tok/s against 2,346 once warm; warming batches of 1 and 32
    alone still gave 798, docs/benchmarks/serve-h200-qwen3-8b-shape-32-streams-*.json).
    A batch of several comes as a real admission does: half of it first, the rest joining
    it while it decodes (a merge of caches), and the first half finishing before the rest
    (a filter), so what those build is built here too.
    Returns the batch sizes its decode steps ran (a JoiningBatchGenerator's)."""
    from omlx_core.kernels.qmm_decode import shape_changes

    batches = dict.fromkeys((1, *shape_changes(generator.model, max_running), max_running))
    decoded: set[int] = set()
    for batch in batches:
        first = (batch + 1) // 2
        uids = set(generator.insert([list(WARMUP_PROMPT)] * first, max_tokens=[WARMUP_TOKENS] * first))
        for step in range(4 * (batch + WARMUP_TOKENS)):  # far more calls than prefill and decode take
            if step == 2 and first < batch:  # the first half decoding: the rest joins it, and outlives it
                uids |= set(generator.insert([list(WARMUP_PROMPT)] * (batch - first),
                                             max_tokens=[WARMUP_TOKENS + 2] * (batch - first)))
            if not uids:
                break
            _, responses = generator.next()
            decoded.add(generator.decoded_rows)
            uids -= {r.uid for r in responses if r.finish_reason is not None}
        if uids:  # never seen: a generator that drops sequences; serving still works, only colder
            log.warning("warm-up: %d dummy sequences did not finish; removed", len(uids))
            generator.remove(list(uids))
    return decoded - {0}


@dataclass
class _Sequence:
    request: Request
    uid: int
    detokenizer: object
    stop_text: StopText
    cached: int = 0  # prompt tokens the prompt cache supplied
    store_at: int = 0  # prompt tokens after which the cache is stored; 0 once done or never


class Engine:
    def __init__(self, registry, scheduler, guard, metrics):
        self.registry = registry
        self.scheduler = scheduler
        self.guard = guard
        self.metrics = metrics
        self.ready = threading.Event()  # set once the startup models are loaded
        self.load_error: Exception | None = None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = Outbox()  # events of the engine thread's current pass
        self._wake = threading.Event()
        self._stopping = False
        self._active: dict[str, dict[int, _Sequence]] = {}  # model id -> uid -> sequence
        self._samplers: dict[tuple, object] = {}  # shared unseeded samplers batch in one call
        self._steps = 0
        self._thread = threading.Thread(target=self._run, name="omlx-engine", daemon=True)

    # Called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def call(self, function) -> concurrent.futures.Future:
        """Run `function()` on the engine thread; its result or exception comes back in a future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((function, future))
        self._wake.set()
        return future

    def wake(self) -> None:
        """Make the engine look at its requests now (e.g. one was cancelled)."""
        self._wake.set()

    def submit(self, request: Request) -> None:
        """Queue a request; raises APIError 503 when the wait queue is full."""
        try:
            self.scheduler.submit(request)
        except Exception:
            self.metrics.queue_rejections.labels(request.model_id).inc()
            raise
        self._wake.set()

    def worst_case_bytes(self, model, prompt_tokens: int, max_tokens: int) -> int:
        chunk = int(model.settings["prefill.chunk_size"])
        return worst_case_kv_bytes(model.kv, prompt_tokens, max_tokens, prefill_chunk=chunk)

    def busy_models(self) -> set[str]:
        """Models with requests generating (engine thread), which must not be unloaded."""
        return {model_id for model_id, sequences in self._active.items() if sequences}

    def active_count(self, model_id: str) -> int:
        return len(self._active.get(model_id, {}))

    # The engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for ref in self.registry.startup:
                self._generator(self.registry.get(ref.name))  # loads and warms it before /health says ready
        except Exception as error:  # noqa: BLE001 - reported by /health and the CLI
            log.error("loading %s failed: %s", ref.name, error)
            self.load_error = error
        self.ready.set()
        while not self._stopping:
            self._run_calls()
            self._admit()
            self._drop_cancelled()
            if not any(self._active.values()):
                self._outbox.flush()
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            for model_id in [m for m, seqs in self._active.items() if seqs]:
                self._step(model_id)
            self._outbox.flush()  # this pass's events in one hand-over to the event loop
            self._steps += 1
            if self._steps % STATS_EVERY_STEPS == 0:
                self._record_kv()
        self._shutdown()

    def _run_calls(self) -> None:
        while True:
            try:
                function, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function())
                except BaseException as error:  # noqa: BLE001 - handed back to the caller
                    future.set_exception(error)

    def _kv_bytes(self, request: Request) -> int:
        model = self.registry.get(request.model_id)
        return self.worst_case_bytes(model, len(request.prompt), request.max_tokens)

    def _make_room(self, request: Request) -> bool:
        """Free memory for a refused request: prompt caches' memory tiers first, then an idle model."""
        for model in self.registry.loaded.values():
            if model.prompt_cache.drop_memory():
                self._charge_prefix_cache(model)
                return True
        return self.registry.evict_one(self.busy_models() | {request.model_id})

    def _admit(self) -> None:
        admitted, refused = self.scheduler.admit(self._kv_bytes, self._make_room)
        if admitted or refused:
            self._update_gauges(None)
        for request, refusal in refused:
            if isinstance(refusal, MemoryRefused):
                self.metrics.memory_rejections.labels(request.model_id).inc()
            self._finish(request, "error" if refusal is not None else "cancelled", error=refusal)
        for request in admitted:
            try:
                self._insert(request)
            except Exception as error:  # noqa: BLE001 - one bad request must not stop the engine
                log.exception("request %s could not start", request.id)
                self._finish(request, "error", error=error)

    def _sampler(self, request: Request):
        if request.seed is not None:
            return make_sampler(request.temperature, request.top_p, request.seed)
        key = (request.temperature, request.top_p)
        if key not in self._samplers:
            self._samplers[key] = make_sampler(request.temperature, request.top_p, None)
        return self._samplers[key]

    def _generator(self, model):
        """The model's JoiningBatchGenerator, made (and warmed up) on first use."""
        from mlx_lm.generate import StopSequences

        from omlx_core.serve.batch_generator import JoiningBatchGenerator, kept_cache_bytes

        if model.generator is None:
            generator = JoiningBatchGenerator(
                model.model, kept_cache_bytes=kept_cache_bytes(self.guard.total_bytes),
                completion_batch_size=self.scheduler.max_running,
                prefill_batch_size=min(int(model.settings["server.prefill_batch"]), self.scheduler.max_running),
                prefill_step_size=int(model.settings["prefill.chunk_size"]))
            if model.settings["server.warmup"]:
                model.decode_sizes = warm_up(generator, self.scheduler.max_running)
            model.generator = generator
            model.prefill_batching = PrefillBatching(generator.prefill_batch_size)
            model.prefill_tokens = prefill_tokens(model.settings)  # once: its auto asks MLX for the backend
            model.stop_sequences = StopSequences([[t] for t in model.tokenizer.eos_token_ids])
            model.no_stop = StopSequences(None)
        return model.generator

    def _insert(self, request: Request) -> None:
        model = self.registry.get(request.model_id)
        self._generator(model)
        prompt, prompt_cache = request.prompt, model.prompt_cache
        hit = prompt_cache.lookup(prompt)
        cached = hit.tokens
        request.cached_tokens = cached
        store_at = prompt_cache.boundary(len(prompt))
        store_at = store_at if store_at > cached else 0
        segments = [prompt[cached:store_at], prompt[store_at:]] if store_at else [prompt[cached:]]
        (uid,) = model.generator.insert_segments(
            [segments], max_tokens=[request.max_tokens], caches=[hit.cache],
            all_tokens=[prompt[:cached]], samplers=[self._sampler(request)],
            stop_sequences=[model.no_stop if request.ignore_eos else model.stop_sequences])
        model.prefill_batching.inserted(uid, len(prompt) - cached)
        self._active.setdefault(model.id, {})[uid] = _Sequence(
            request, uid, model.tokenizer.detokenizer, StopText(request.stop), cached, store_at)
        if hit.cache is not None:
            self._charge_prefix_cache(model)
        self._outbox.add(request, Started(cached))
        self.metrics.prompt_tokens.labels(model.id).inc(len(request.prompt))
        self.metrics.cached_tokens.labels(model.id).inc(cached)
        self._update_gauges(model.id)

    def _step(self, model_id: str) -> None:
        model = self.registry.loaded[model_id]
        generator = model.generator
        chunk, budget = self._prefill_sizes(model)
        generator.prefill_step_size = chunk
        generator.prefill_batch_size = model.prefill_batching.batch_size(chunk, budget=budget)
        started = time.perf_counter()
        try:
            prompt_responses, responses = generator.next()
        except Exception as error:  # noqa: BLE001 - fail this model's requests, keep serving
            log.exception("generation step failed for %s", model_id)
            for sequence in list(self._active.get(model_id, {}).values()):
                self._remove(model, sequence, "error", error=error)
            return
        seconds = time.perf_counter() - started
        model.prefill_batching.stepped(prompt_responses)
        phase = "prefill" if prompt_responses else "decode"
        self.metrics.step.labels(model_id, phase).observe(seconds)
        new_sizes = self._new_decode_sizes(model, generator.decoded_rows)
        if log.isEnabledFor(logging.DEBUG):  # every step's shape, for `serve.py --step-log`
            log.debug("%s: %s step at %.4f: %.2f ms, %d sequences decoded, %d prompt tokens prefilled", model_id,
                      phase, time.monotonic() - seconds, seconds * 1e3, generator.decoded_rows,
                      generator.prefilled_tokens)
        if seconds > SLOW_STEP_S:
            log.info("%s: a step took %.2f s (%d sequences decoded, %d prompts prefilling; %s)", model_id, seconds,
                     generator.decoded_rows, len(prompt_responses),
                     f"first decode at batch size {', '.join(map(str, new_sizes))}" if new_sizes
                     else "no decode batch size met first")
        sequences = self._active[model_id]
        self._store_prefixes(model, sequences, prompt_responses)
        stopped = []
        for response in responses:
            sequence = sequences.get(response.uid)
            if sequence is None:
                continue
            if self._advance(model, sequence, response):
                stopped.append(sequence)
        if stopped:
            generator.remove([s.uid for s in stopped])

    def _prefill_sizes(self, model) -> tuple[int, int]:
        """(each prompt's chunk, the step's token budget): prefill.chunk_size and
        server.prefill_tokens (as `_generator` resolved it), both scaled by the memory guard's
        adaptive chunk (which halves them above the soft watermark), the chunk never above
        the budget."""
        setting = int(model.settings["prefill.chunk_size"])
        chunk = self.guard.prefill_chunk_size(setting)
        budget = max(1, model.prefill_tokens * chunk // setting)
        return min(chunk, budget), budget

    @staticmethod
    def _new_decode_sizes(model, rows: int) -> list[int]:
        """The step's decode batch size (`rows`, joined prompts included) if it ran for the
        first time: a size met first builds what is made per shape (mx.compile traces,
        cuDNN graphs), so a slow step says whether it met one."""
        new = sorted({rows} - {0} - model.decode_sizes)
        model.decode_sizes.update(new)
        return new

    def _store_prefixes(self, model, sequences: dict, prompt_responses) -> None:
        """Store the cache of each prompt that just reached its last whole block."""
        done = [sequences[r.uid] for r in prompt_responses
                if r.end_of_segment and r.uid in sequences and sequences[r.uid].store_at
                and r.progress[0] == sequences[r.uid].store_at - sequences[r.uid].cached]
        if not done:
            return
        extracted = model.generator.extract_cache([s.uid for s in done])
        for sequence in done:
            cache, _ = extracted[sequence.uid]
            try:
                model.prompt_cache.store(sequence.request.prompt[:sequence.store_at], cache)
            except Exception:  # noqa: BLE001 - a cache that cannot be stored costs reuse, not the request
                log.exception("storing the prompt cache of %s failed", sequence.request.id)
            sequence.store_at = 0
        del extracted
        self._charge_prefix_cache(model)

    def _advance(self, model, sequence: _Sequence, response) -> bool:
        """Turn one token into text for its request; True if a stop string ended it early."""
        request, detokenizer = sequence.request, sequence.detokenizer
        request.completion_tokens += 1
        if request.first_token_at is None:
            request.first_token_at = time.monotonic()
        if response.finish_reason != "stop":  # the EOS token itself is not text
            detokenizer.add_token(response.token)
        if response.finish_reason is not None:
            detokenizer.finalize()
        text = sequence.stop_text.feed(detokenizer.last_segment)
        if sequence.stop_text.stopped:
            if text:
                self._outbox.add(request, Delta(text, request.completion_tokens))
            self._end(model, sequence, "stop")
            return response.finish_reason is None
        if response.finish_reason is not None:
            text += sequence.stop_text.flush()
        if text:
            self._outbox.add(request, Delta(text, request.completion_tokens))
        if response.finish_reason is not None:
            self._end(model, sequence, response.finish_reason)
        return False

    def _drop_cancelled(self) -> None:
        for model_id, sequences in self._active.items():
            gone = [s for s in sequences.values() if s.request.cancelled]
            if gone:
                model = self.registry.loaded[model_id]
                model.generator.remove([s.uid for s in gone])
                for sequence in gone:
                    self._end(model, sequence, "cancelled")

    def _remove(self, model, sequence: _Sequence, reason: str, error: Exception | None = None) -> None:
        model.generator.remove([sequence.uid])
        self._end(model, sequence, reason, error)

    def _end(self, model, sequence: _Sequence, reason: str, error: Exception | None = None) -> None:
        self._active[model.id].pop(sequence.uid, None)
        model.prefill_batching.removed([sequence.uid])
        self._finish(sequence.request, reason, error)
        self._update_gauges(model.id)

    def _finish(self, request: Request, reason: str, error: Exception | None = None) -> None:
        self.scheduler.finish(request)
        request.finished_at = time.monotonic()
        self.metrics.generation_tokens.labels(request.model_id).inc(request.completion_tokens)
        self.metrics.finished(request.model_id, request.arrived, request.first_token_at,
                              request.finished_at, request.completion_tokens)
        self._outbox.add(request, Finished(reason, len(request.prompt), request.completion_tokens,
                                           request.cached_tokens, error))
        self._wake.set()

    def _charge_prefix_cache(self, model) -> None:
        self.guard.register_extra(f"prefix_cache:{model.id}", model.prompt_cache.held_bytes())

    def _record_kv(self) -> None:
        for model_id, sequences in self._active.items():
            model = self.registry.loaded.get(model_id)
            if model is None:
                continue
            total = 0
            for sequence in sequences.values():
                request = sequence.request
                live = estimate_kv_bytes(model.kv, len(request.prompt) + request.completion_tokens)
                self.guard.record_kv(request.id, live)
                total += live
            self.metrics.kv_bytes.labels(model_id).set(total)

    def _update_gauges(self, model_id: str | None) -> None:
        counts = self.scheduler.counts_by_model()
        for name in set(counts) | set(self.registry.loaded) | ({model_id} - {None}):
            running, waiting = counts.get(name, (0, 0))
            self.metrics.running.labels(name).set(running)
            self.metrics.waiting.labels(name).set(waiting)
        if model_id is not None and not self._active.get(model_id):
            self.metrics.kv_bytes.labels(model_id).set(0)

    def _shutdown(self) -> None:
        for model_id, sequences in self._active.items():
            model = self.registry.loaded.get(model_id)
            for sequence in list(sequences.values()):
                self._remove(model, sequence, "cancelled")
        self._outbox.flush()
        for model in self.registry.loaded.values():
            if model.generator is not None:
                model.generator.close()
            model.prompt_cache.close()  # write what is pending, so a restart finds it
