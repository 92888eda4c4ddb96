"""The offline benchmark: one process, every variant on identical prompts.

For each context length: the prompts are built once from the seed; every variant runs
`warmup` discarded times (one shared warm-up, so no variant gets a colder machine), then
the variants take turns, A B A B …, for `repeats` rounds. Interleaving spreads slow drift
(thermal, a neighbour process) evenly over the variants instead of onto whichever ran
last. The model is loaded once per distinct prefill-lane setup (variants that differ only in
other settings share it); stock mlx-lm runs on an unsplit copy, as mlx-lm would load it.
"""

from collections.abc import Callable
from dataclasses import dataclass

from omlx_core.bench.compare import compare_results
from omlx_core.bench.memory import PeakMemory
from omlx_core.bench.report import finite, header
from omlx_core.bench.runs import Measurement, run_generation, run_mlx_lm
from omlx_core.bench.schema import OFFLINE_METRICS
from omlx_core.bench.stats import summarize
from omlx_core.bench.variants import MLX_LM, Variant, prefill_settings
from omlx_core.bench.workload import Workload, ordinary_token_ids, synthetic_prompts
from omlx_core.errors import OmlxError
from omlx_core.models.resolve import ModelRef
from omlx_core.settings import EffectiveSettings

Progress = Callable[[int, int, str], None]  # (runs done, runs in all, what runs next)


@dataclass
class Prepared:
    """A model loaded and prepared for timed runs (bench and tune share it)."""

    model: object
    tokenizer: object
    vocabulary: object
    suppress: set[int]
    lanes: object = None  # prefill.install.LaneReport, None for the stock model
    kernels: object = None  # kernels.registry.KernelReport, None for the stock model


def _vocab_size(ref: ModelRef) -> int:
    from omlx_core.models.checkpoint import read_config

    config = read_config(ref.path)
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


def prepare_model(ref: ModelRef, settings: EffectiveSettings | None) -> Prepared:
    """The model as `settings` prepare it (prefill lanes installed); None = stock, unsplit."""
    from omlx_core.models.clone_fp16 import is_fp16_clone
    from omlx_core.models.load import load_model
    from omlx_core.kernels.registry import install_kernels
    from omlx_core.models.fingerprint import model_fingerprint
    from omlx_core.decode.dense_copy import install_dense_copy
    from omlx_core.prefill.install import install_prefill

    model, tokenizer = load_model(ref)
    lanes = kernels = None
    if settings is not None:
        kernels = install_kernels(model, model_fingerprint(ref.path), settings)
        lanes = install_prefill(model, settings, fp16_clone=is_fp16_clone(ref.path),
                              warmup_tokens=int(settings["prefill.split_min_tokens"]), kernels=kernels)
        install_dense_copy(model, settings)  # as serve does (compute.dense_copy)
    vocabulary = ordinary_token_ids(tokenizer, _vocab_size(ref))
    return Prepared(model, tokenizer, vocabulary, set(tokenizer.eos_token_ids), lanes, kernels)


def install_key(settings: EffectiveSettings | None) -> tuple:
    """Settings whose prefill install (lanes, fast paths), kernels and decode paths agree
    share one prepared model."""
    if settings is None:
        return ("stock",)
    return tuple((key, str(settings[key])) for key in sorted(settings)
                 if key.startswith(("prefill.", "kernels.", "compute.", "decode.")) and key != "prefill.chunk_size")


def _run_once(loaded: Prepared, variant: Variant, prompts, gen: int, memory: PeakMemory) -> Measurement:
    if variant.runner == MLX_LM:
        return run_mlx_lm(loaded.model, loaded.tokenizer, prompts, gen, memory)
    measurement = run_generation(loaded.model, prompts, gen, variant.chunk_size,
                                 loaded.suppress, memory)
    if measurement.prompt_tokens != prompts.shape[1] or measurement.generated_tokens != gen:
        raise OmlxError(f"variant {variant.name}: fed {measurement.prompt_tokens} prompt tokens "
                        f"and got {measurement.generated_tokens}, not {prompts.shape[1]} and {gen}")
    return measurement


def _result(variant: Variant, ctx: int, workload: Workload, runs: list[Measurement],
            rss_scope: str) -> dict:
    samples = {metric: [run.metrics()[metric] for run in runs] for metric in OFFLINE_METRICS}
    last = runs[-1]
    return {
        "variant": variant.name, "ctx": ctx, "batch": workload.batch, "gen": workload.gen,
        "tokens": {"prompt": last.prompt_tokens, "generated": last.generated_tokens,
                   "cache": last.cache_tokens},
        "rss_scope": rss_scope,
        "metrics": {metric: summarize(values).as_dict() for metric, values in samples.items()},
    }


def run_offline(ref: ModelRef, workload: Workload, variants: list[Variant],
                base_settings: EffectiveSettings, on_progress: Progress | None = None) -> dict:
    """Measure every variant on `workload`; returns an `omlx.bench/1` offline document.

    With two or more variants, each one after the first is compared against the first.
    """
    from omlx_core.models.fingerprint import model_fingerprint

    document = header("offline")
    on_progress = on_progress or (lambda done, total, what: None)
    total = len(workload.ctx) * (workload.warmup + workload.repeats) * len(variants)
    done = 0
    on_progress(done, total, "loading model")
    models: dict[tuple, Prepared] = {}
    for variant in variants:
        key = install_key(variant.settings)
        if key not in models:
            models[key] = prepare_model(ref, variant.settings)
    loaded_for = {variant.name: models[install_key(variant.settings)] for variant in variants}
    loaded = next(iter(models.values()))
    memory = PeakMemory()
    results = []
    for ctx in workload.ctx:
        prompts = synthetic_prompts(loaded.vocabulary, ctx, workload.batch, workload.seed)
        runs: dict[str, list[Measurement]] = {variant.name: [] for variant in variants}
        for round_ in range(workload.warmup + workload.repeats):
            warm = round_ < workload.warmup
            for variant in variants:
                label = f"ctx {ctx} {variant.name} " + ("warm-up" if warm else
                                                        f"{round_ - workload.warmup + 1}/{workload.repeats}")
                on_progress(done, total, label)
                measurement = _run_once(loaded_for[variant.name], variant, prompts, workload.gen, memory)
                if not warm:
                    runs[variant.name].append(measurement)
                done += 1
        for variant in variants:
            results.append(_result(variant, ctx, workload, runs[variant.name], memory.rss_scope))
    on_progress(done, total, "done")

    reference = variants[0].name
    comparisons = []
    for variant in variants[1:]:
        comparisons += compare_results([r for r in results if r["variant"] == reference],
                                       [r for r in results if r["variant"] == variant.name],
                                       reference, variant.name)
    document.update({
        "model": {"name": ref.name, "path": str(ref.path), "fingerprint": model_fingerprint(ref.path)},
        "settings": prefill_settings(base_settings),
        "workload": workload.as_dict(),
        "variants": [{**variant.describe(),
                      "lanes": loaded_for[variant.name].lanes.as_dict() if loaded_for[variant.name].lanes else None,
                      "kernels": (loaded_for[variant.name].kernels.as_dict()["kernels"]
                                  if loaded_for[variant.name].kernels else None)}
                     for variant in variants],
        "results": results,
        "comparisons": comparisons,
        "gate": None,
    })
    return finite(document)
