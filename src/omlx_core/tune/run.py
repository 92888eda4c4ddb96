"""`omlx tune` from Python: build the search space, run the procedure, stage the result.

The recommendation goes into the model's working profile (`settings.edit`, stage=True):
the active profile is never touched until `save=True` (or `omlx settings save`) makes
the working profile a named, active one. The report is one JSON document (`omlx.tune/1`)
with every candidate's figures, the verification, the recommendation, the model and
hardware fingerprints and the date; `export_toml` writes the same for people to diff.
"""

from pathlib import Path

import mlx.core as mx

from omlx_core.bench.report import finite, header
from omlx_core.bench.variants import VariantSpec, variant_settings
from omlx_core.bench.workload import Workload
from omlx_core.hardware import mlx_backend
from omlx_core.tune.decode import tune_dense_copy
from omlx_core.tune.measure import Calibrator
from omlx_core.tune.search import Event, tune
from omlx_core.tune.space import search_space

SCHEMA = "omlx.tune/1"


def build_space(ref, settings, max_ctx: int):
    """The search space for `ref` here: its split targets, checkpoint kind and lanes."""
    import gc

    from omlx_core.models.checkpoint import read_config
    from omlx_core.models.clone_fp16 import is_fp16_clone
    from omlx_core.models.load import load_model
    from omlx_core.prefill.lanes import lane_statuses
    from omlx_core.prefill.plan import find_targets

    model, _ = load_model(ref, lazy=True)  # structure and shapes only: no weights read
    targets = find_targets(model)
    del model
    gc.collect()
    mx.clear_cache()
    lanes = {lane.name: lane for lane in lane_statuses(settings)}
    return search_space(targets, cpu_lane=(lanes["cpu"].eligible, lanes["cpu"].reason),
                        fp16_clone=is_fp16_clone(ref.path),
                        quantized=read_config(ref.path).get("quantization") is not None,
                        max_ctx=max_ctx, accelerator=mlx_backend() != "cpu",
                        ane_lane=(lanes["ane"].eligible, lanes["ane"].reason))


def run_tune(ref, home: Path, workload: Workload, budget_s: float,
             on_event: Event = lambda what, result: None, calibrator_class=Calibrator,
             decode_batch: int | None = None) -> dict:
    """Tune `ref` on this machine; returns the report (nothing is staged yet). Prefill first
    (the search space); then, on a quantized checkpoint, the dense copy for batched decode at
    `decode_batch` sequences (None: the model's server.max_concurrency; 0: not measured)."""
    from omlx_core.memory.capacity import total_memory_bytes, watermark_bytes
    from omlx_core.models.checkpoint import read_config
    from omlx_core.models.fingerprint import model_fingerprint

    settings = variant_settings(home, ref.key, VariantSpec())
    max_ctx = max(workload.ctx)
    space = build_space(ref, settings, max_ctx)
    hard = watermark_bytes(settings["memory.hard_watermark"], total_memory_bytes(), "memory.hard_watermark")
    calibrator = calibrator_class(
        ref, lambda sets: variant_settings(home, ref.key, VariantSpec(None, sets)), workload, hard)
    outcome = tune(space, calibrator, max_ctx, budget_s, on_event)
    recommended = outcome.recommended.settings()
    batch = int(settings["server.max_concurrency"]) if decode_batch is None else decode_batch
    decode = None
    if read_config(ref.path).get("quantization") is None:
        outcome.notes.append("compute.dense_copy: left out, the checkpoint is not quantized")
    elif batch < 1:
        outcome.notes.append("compute.dense_copy: not measured (--decode-batch 0)")
    else:
        decode = tune_dense_copy(calibrator, recommended, batch, on_event=on_event)
        recommended["compute.dense_copy"] = decode.choice
    best = outcome.best
    verified = outcome.verification.get("default" if outcome.is_default else "recommended")
    document = header("tune")
    document["schema"] = SCHEMA
    document.update({
        "model": {"name": ref.name, "path": str(ref.path), "fingerprint": model_fingerprint(ref.path)},
        "workload": workload.as_dict(), "budget_s": budget_s,
        "budget_exhausted": outcome.budget_exhausted,
        "controls": [{"name": c.name, "values": list(c.values)} for c in space.controls],
        "gdn_floor_share": space.gdn_floor_share, "notes": outcome.notes,
        "candidates": [r.as_dict() for r in outcome.candidates],
        "best": best.as_dict(), "default": outcome.default.as_dict(),
        "verification": outcome.verification, "memory": outcome.memory,
        "hard_watermark_bytes": hard, "model_loads": calibrator.loads,
        "decode": decode.as_dict() if decode else None,
        "recommendation": {
            "settings": recommended,
            "label": outcome.recommended.label + (f" dense_copy={decode.choice}" if decode else ""),
            "decode_reason": decode.reason if decode else None,
            "is_default": outcome.is_default, "reason": outcome.reason,
            "verified_prefill_tps": (verified or outcome.default.as_dict())["prefill_tps"],
            "best_measured_prefill_tps": best.prefill_tps,
        },
        "staged": None, "saved_profile": None,
    })
    return finite(document)


def stage(document: dict, home: Path, model_key: str, save: bool, profile: str | None) -> dict:
    """Write the recommendation to the working profile, and save it as active if asked."""
    from omlx_core.settings.edit import save_working, set_setting

    for key, text in document["recommendation"]["settings"].items():
        set_setting(home, key, text, model_key=model_key, stage=True)
    document["staged"] = {"profile": "working", "model_key": model_key}
    if save:
        document["saved_profile"] = save_working(home, model_key, profile)
    return document


def export_toml(document: dict, path: Path) -> None:
    """The report as TOML (None values left out, which TOML cannot hold), written atomically."""
    import tomli_w

    from omlx_core.settings.store import write_text_atomic

    def clean(node):
        if isinstance(node, dict):
            return {str(k): clean(v) for k, v in node.items() if v is not None}
        if isinstance(node, list):
            return [clean(v) for v in node if v is not None]
        return node

    write_text_atomic(Path(path), tomli_w.dumps(clean(document)))
