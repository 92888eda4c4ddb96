#!/usr/bin/env python
"""The cost of admitting prompts into `omlx serve`'s batch: one prefill forward of B prompts,
and the engine steps that admit N new prompts beside M running sequences.

Why: every running stream waits for a step that prefills admissions, so at 32 streams the
prefill steps are a large share of the wall time (docs/benchmarks/
serve-h100-qwen3-8b-shape-32-streams-prefill-batching.json). This splits that cost into a
forward's fixed part and its part per prompt, which is what sizes a prefill step's batch.

How: the model is loaded as `omlx serve` loads it (its settings, kernels and fast paths,
`OMLX_*` variables included). `forward BxL`: ms of one prefill forward of B prompts of L
random tokens on a fresh cache, waited for, --repeats times, for each B of --batches and L
of --tokens; the first of a shape builds what is made per shape, and its excess over the
repeats is what a serve step meeting a new shape pays. Admission trials: a mlx-lm
`BatchGenerator` (as the engine makes it) decodes --running sequences, then N prompts of
L-S..L+S-1 tokens (S = --spread; 0: all of L) are inserted, --trials times for each N of
--new, and each step until they all generate is timed: (ms, prompt responses, generation
responses). A trial's first steps at a new N or L meet new shapes (the split into
generation decodes the N new sequences on their own, then the merged batch), its repeats
do not. `--phases` splits each admission step into mlx-lm's parts, each waited for (so
they no longer overlap): `decode` (the running batch's step), `split` (the prompts moving
to generation decoded on their own), `merge` (joined to the running batch) and `prefill`
(the prompt batch's forward). `--no-clear-cache` makes the MLX `clear_cache` that mlx-lm
calls after each prompt chunk a no-op, to see what it costs.

Finish trials (`--finish K[,K...]`): --finish-running sequences decode (prompts of L tokens), K
of them finish together half-way through a window of --window steps, run as the engine runs
them (each step's tokens read while the next computes, waited for only at the window's two
ends), and the window is timed against the one just before it, where every row decodes and
none finishes: `excess_ms` is what the finish cost, its filter of the caches included (and
in mlx-lm's generator, each finished row's cache taken out).

    python scripts/bench/admission.py --model PATH [--home DIR] [--batches 1,8,16,32]
        [--tokens 128[,L...]] [--spread 8] [--running 16] [--new 16[,N...]] [--trials 3]
        [--phases] [--no-clear-cache] [--finish K[,K...]] [--finish-running 32] [--window 8]
        [--generators omlx,mlx-lm] [--json]
"""

import argparse
import contextlib
import functools
import importlib
import json
import random
import time

from omlx_core.errors import OmlxError
from omlx_core.units import parse_counts


def timed_ms(function) -> tuple[float, object]:
    import mlx.core as mx

    mx.synchronize()
    start = time.perf_counter()
    result = function()
    mx.synchronize()
    return (time.perf_counter() - start) * 1000, result


GENERATORS = ("omlx", "mlx-lm")


def generator_parts(kind: str) -> tuple:
    """The generator of `kind` (made as the engine makes it) and its step's parts (see
    --phases): name -> (class, method)."""
    generate = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is also a function)
    if kind == "mlx-lm":
        return generate.BatchGenerator, {
            "decode": (generate.GenerationBatch, "next"), "split": (generate.PromptProcessingBatch, "generate"),
            "merge": (generate.GenerationBatch, "extend"), "prefill": (generate.PromptProcessingBatch, "prompt")}
    from omlx_core.memory.capacity import total_memory_bytes
    from omlx_core.serve.batch_generator import (CachedPromptBatch, JoiningBatchGenerator, JoiningGenerationBatch,
                                                 kept_cache_bytes)

    as_served = functools.partial(JoiningBatchGenerator, kept_cache_bytes=kept_cache_bytes(total_memory_bytes()))
    return as_served, {
        "join": (JoiningBatchGenerator, "_join"), "decode": (JoiningGenerationBatch, "next"),
        "prefill": (CachedPromptBatch, "prompt")}


@contextlib.contextmanager
def phase_timers(spent: dict, parts: dict):
    """Wrap a generator's step `parts` so that each adds its waited-for ms to `spent[name]`."""
    originals = []

    def timed(name, method):
        def wrapper(*args, **kwargs):
            if depth:  # a part inside another (generate's own prompt) counts in the outer one
                return method(*args, **kwargs)
            depth.append(name)
            try:
                ms, result = timed_ms(lambda: method(*args, **kwargs))
            finally:
                depth.pop()
            spent[name] = round(spent.get(name, 0.0) + ms, 1)
            return result
        return wrapper

    depth: list[str] = []
    for name, (cls, attribute) in parts.items():
        originals.append((cls, attribute, getattr(cls, attribute)))
        setattr(cls, attribute, timed(name, getattr(cls, attribute)))
    try:
        yield
    finally:
        for cls, attribute, method in originals:
            setattr(cls, attribute, method)


def load(home: str | None, model: str):
    from omlx_core.home import resolve_home
    from omlx_core.memory.guard import MemoryGuard
    from omlx_core.serve.registry import ModelRegistry

    registry = ModelRegistry(resolve_home(home), [model], MemoryGuard())
    return registry.get(registry.default_id).model


def forwards(model, batches: list[int], lengths: list[int], repeats: int, rng: random.Random) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    vocab = model.args.vocab_size
    rows = []
    for batch, tokens in ((b, t) for t in lengths for b in batches):
        prompt = mx.array([[rng.randrange(1, vocab) for _ in range(tokens)] for _ in range(batch)])
        times = []
        for _ in range(repeats):
            cache = make_prompt_cache(model)
            ms, _ = timed_ms(lambda: mx.eval(model(prompt, cache=cache)[:, -1]))
            times.append(round(ms, 1))
        rows.append({"batch": batch, "tokens": tokens, "ms": times})
    return rows


def admissions(model, kind: str, running: int, news: list[int], tokens: int, spread: int, trials: int,
               rng: random.Random, phases: bool = False) -> list[dict]:
    make_generator, parts = generator_parts(kind)
    vocab = model.args.vocab_size
    most = running + max(news)
    generator = make_generator(model, completion_batch_size=most, prefill_batch_size=most)
    rows = []
    try:
        for new in (n for n in news for _ in range(trials)):
            lengths = [tokens + (rng.randrange(-spread, spread) if spread else 0) for _ in range(running + new)]
            prompts = [[rng.randrange(1, vocab) for _ in range(length)] for length in lengths]
            generator.prefill_batch_size = running
            old = set(generator.insert(prompts[:running], max_tokens=[10_000] * running))
            while len(generator.next()[1]) < running:
                pass
            decode_ms, _ = timed_ms(generator.next)
            generator.prefill_batch_size = new
            fresh = set(generator.insert(prompts[running:], max_tokens=[4] * new))
            steps = []
            while True:
                spent: dict = {}
                with phase_timers(spent, parts) if phases else contextlib.nullcontext():
                    ms, (prompt_responses, responses) = timed_ms(generator.next)
                steps.append([round(ms, 1), len(prompt_responses), len(responses)] + ([spent] if phases else []))
                if sum(r.uid in fresh for r in responses) == new:
                    break
            generator.remove(list(old | fresh))
            rows.append({"generator": kind, "new": new, "decode_ms": round(decode_ms, 1), "steps": steps})
    finally:
        generator.close()
    return rows


def finishes(model, kind: str, running: int, counts: list[int], tokens: int, window: int, trials: int,
             rng: random.Random) -> list[dict]:
    """What sequences finishing costs the steps around them: `running` sequences decode, and
    `count` of them finish together in the middle of a window of `window` pipelined steps,
    against the window just before it (every row decoding, none finishing)."""
    make_generator, _ = generator_parts(kind)
    vocab = model.args.vocab_size
    generator = make_generator(model, completion_batch_size=running, prefill_batch_size=running)
    last = 2 + window + window // 2  # the finishing rows' last token: half-way through the second window

    def window_steps() -> list:
        """`window` steps as the engine runs them (each step's tokens read while the next
        computes; timed_ms waits only at both ends); their generation responses."""
        return [response for _ in range(window) for response in generator.next()[1]]

    rows = []
    try:
        for count in (c for c in counts for _ in range(trials)):
            prompts = [[rng.randrange(1, vocab) for _ in range(tokens)] for _ in range(running)]
            uids = generator.insert(prompts, max_tokens=[last] * count + [10_000] * (running - count))
            made = 0  # tokens of a finishing row (they all start together)
            while made < 2:
                made += sum(r.uid == uids[0] for r in generator.next()[1])
            steady_ms, _ = timed_ms(window_steps)
            finish_ms, responses = timed_ms(window_steps)
            finished = sum(r.finish_reason is not None for r in responses)
            generator.remove(uids[count:])
            rows.append({"generator": kind, "running": running, "finishing": count, "finished": finished,
                         "steady_ms": round(steady_ms, 1), "finish_ms": round(finish_ms, 1),
                         "excess_ms": round(finish_ms - steady_ms, 1)})
    finally:
        generator.close()
    return rows


def run(args) -> dict:
    import mlx.core as mx

    model = load(args.home, args.model)
    rng = random.Random(args.seed)
    clear_cache = mx.clear_cache
    report = {"command": "scripts/bench/admission.py", "model": args.model,
              "device": str(mx.default_device()), "clear_cache": not args.no_clear_cache,
              "forward": forwards(model, args.batches, args.tokens, args.repeats, rng)}
    if args.no_clear_cache:
        mx.clear_cache = lambda: None
    try:
        report["admission"] = [row for kind in args.generators
                               for row in admissions(model, kind, args.running, args.new, args.tokens[0], args.spread,
                                                     args.trials, rng, args.phases)]
        if args.finish:
            report["finish"] = [row for kind in args.generators
                                for row in finishes(model, kind, args.finish_running, args.finish, args.tokens[0],
                                                    args.window, args.trials, rng)]
    finally:
        mx.clear_cache = clear_cache
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a path or a name under $OMLX_HOME/models")
    parser.add_argument("--home", default=None, help="omlx home (default: $OMLX_HOME or ~/.omlx)")
    parser.add_argument("--batches", default="1,8,16,32", help="prompts per timed forward")
    parser.add_argument("--tokens", default="128", help="prompt tokens per forward, comma-separated (admission: the first)")
    parser.add_argument("--spread", type=int, default=8, help="admitted prompts' lengths vary by +-this (0: none)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--running", type=int, default=16, help="sequences decoding before the admission")
    parser.add_argument("--new", default="16", help="prompts admitted together, comma-separated: --trials each")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generators", default="omlx", help="whose steps, comma-separated: omlx, mlx-lm")
    parser.add_argument("--phases", action="store_true",
                        help="time each admission step's parts (decode, prefill, join or split and merge), each waited for")
    parser.add_argument("--no-clear-cache", action="store_true", help="mlx-lm's clear_cache a no-op")
    parser.add_argument("--finish", default="", help="sequences finishing together, comma-separated: --trials "
                        "each (none by default)")
    parser.add_argument("--finish-running", type=int, default=32, help="sequences decoding when some finish")
    parser.add_argument("--window", type=int, default=8, help="pipelined steps a finish is timed in")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        args.batches, args.tokens, args.new = (parse_counts(getattr(args, name), f"--{name}")
                                               for name in ("batches", "tokens", "new"))
        args.finish = parse_counts(args.finish, "--finish") if args.finish else []
    except OmlxError as error:
        raise SystemExit(f"admission.py: {error}") from None
    wrong = [count for count in args.finish if not 1 <= count <= args.finish_running]
    if wrong:
        raise SystemExit(f"admission.py: --finish {wrong[0]}: between 1 and --finish-running "
                         f"({args.finish_running}) sequences can finish")
    if args.window < 2:
        raise SystemExit(f"admission.py: --window {args.window}: use 2 or more steps")
    args.generators = args.generators.split(",")
    unknown = [kind for kind in args.generators if kind not in GENERATORS]
    if unknown:
        raise SystemExit(f"admission.py: --generators {unknown[0]!r}: choose from {', '.join(GENERATORS)}")
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for row in report["forward"]:
        print(f"forward {row['batch']}x{row['tokens']}: {row['ms']} ms")
    for row in report["admission"]:
        print(f"{row['generator']} admission of {row['new']}: decode {row['decode_ms']} ms before; "
              f"steps (ms, prompts, generating) {row['steps']}")
    for row in report.get("finish", []):
        print(f"{row['generator']}: {row['finishing']} of {row['running']} finishing: {row['finish_ms']} ms for "
              f"{args.window} pipelined steps against {row['steady_ms']} ms before ({row['excess_ms']:+} ms)")


if __name__ == "__main__":
    main()
