"""Check that a converted checkpoint still behaves like its reference: same greedy text.

Used after `clone-fp16` and by the tuner's verification reload. The two models run one
after the other (never both in memory): a fixed chat prompt, then N greedy steps,
recording each step's logits. Both compute in float32 by default (weights upcast exactly
after loading), so the check measures what the conversion changed, the weights, and not
the backend's fp16 arithmetic, which on MLX's CPU backend is also ~40x slower. Logits
are compared while both runs have seen the same tokens, so a late divergence does not
hide an early difference. A forward pass the backend cannot run
(MLX's CPU routed-expert matmul runs only float32, so deepseek_v41 in fp16 cannot run on
the CPU) makes the check "unavailable" with that reason, not a crash.
"""

import gc
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from omlx_core.errors import OmlxError

PROMPT = "Questions are the beginning of science. Why does the moon change its shape?"


@dataclass
class Verification:
    status: str  # "passed" (same greedy tokens), "diverged", "unavailable" or "failed"
    steps: int
    compute_dtype: str  # "float32", or "as loaded"
    tokens_matched: int  # leading greedy tokens that agree
    max_abs_logit_diff: float | None
    reason: str | None = None

    @property
    def tokens_match(self) -> bool:
        return self.tokens_matched == self.steps

    def to_dict(self) -> dict:
        return asdict(self) | {"tokens_match": self.tokens_match}


@dataclass
class _Trace:
    tokens: list[int]
    logits: np.ndarray  # [steps, vocab] float32: the logits each token was chosen from


class _CannotRun(Exception):
    """The backend refused a forward pass (an unsupported op or dtype on this device)."""


def _load(path: Path):
    from mlx_lm.utils import load

    try:
        return load(str(path))
    except Exception as error:  # noqa: BLE001 - any load failure is reported the same way
        raise OmlxError(f"{path}: mlx-lm cannot load it: {error}") from error


def _greedy_trace(model, prompt: list[int], steps: int) -> _Trace:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens, rows = [], []
    try:
        logits = model(mx.array([prompt]), cache=cache)[0, -1]
        for _ in range(steps):
            row = logits.astype(mx.float32)
            mx.eval(row)
            rows.append(np.array(row))
            token = int(np.argmax(rows[-1]))
            tokens.append(token)
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
    except (RuntimeError, ValueError) as error:
        raise _CannotRun(str(error).splitlines()[0]) from error
    return _Trace(tokens, np.stack(rows) if rows else np.zeros((0, 0), np.float32))


def _prompt_tokens(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text)


def _upcast(model, dtype) -> None:
    import mlx.core as mx
    from mlx.utils import tree_map

    model.update(tree_map(lambda v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v,
                          model.parameters()))
    mx.eval(model.parameters())


def _run(path: Path, prompt_text: str, steps: int, role: str, compute_dtype: str | None) -> _Trace:
    """Load, tokenize and trace one model, then drop it."""
    import mlx.core as mx

    model, tokenizer = _load(path)
    prompt = _prompt_tokens(tokenizer, prompt_text)
    loaded = _float_dtype(model)
    if compute_dtype:
        _upcast(model, getattr(mx, compute_dtype))
    try:
        return _greedy_trace(model, prompt, steps)
    except _CannotRun as error:
        computed = f", computing in {compute_dtype}" if compute_dtype else ""
        raise _CannotRun(f"the {role} ({loaded}{computed}) cannot run a forward pass on "
                         f"the {mx.default_device().type.name} device: {error}") from error
    finally:
        del model
        gc.collect()
        mx.clear_cache()


def _float_dtype(model) -> str:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    kinds = {str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())
             if mx.issubdtype(v.dtype, mx.floating)}
    return "/".join(sorted(kinds)) or "no float weights"


def compare_greedy(reference: Path, candidate: Path, *, steps: int = 32, prompt: str = PROMPT,
                   compute_dtype: str | None = "float32") -> Verification:
    """Run `prompt` through both checkpoints for `steps` greedy tokens and compare.

    `compute_dtype=None` runs each model in the dtypes it loads with.
    "failed" when the candidate cannot load or gives non-finite logits; "unavailable"
    when a forward pass cannot run here (the candidate still loaded); OmlxError only if
    the reference itself cannot load.
    """
    compute = compute_dtype or "as loaded"
    try:
        ref = _run(reference, prompt, steps, "source", compute_dtype)
    except _CannotRun as error:
        try:
            _load(candidate)
        except OmlxError as load_error:
            return Verification("failed", steps, compute, 0, None, str(load_error))
        gc.collect()
        return Verification("unavailable", steps, compute, 0, None, str(error))
    try:
        got = _run(candidate, prompt, steps, "clone", compute_dtype)
    except OmlxError as error:
        return Verification("failed", steps, compute, 0, None, str(error))
    except _CannotRun as error:
        return Verification("unavailable", steps, compute, 0, None, str(error))

    if not np.isfinite(got.logits).all():
        bad = int(np.argmin(np.isfinite(got.logits).all(axis=1)))
        return Verification("failed", steps, compute, 0, None,
                            f"the clone's logits are not finite (greedy step {bad})")
    matched = 0
    while matched < steps and ref.tokens[matched] == got.tokens[matched]:
        matched += 1
    compared = min(matched + 1, steps)  # step `matched` still had the same context
    diff = float(np.max(np.abs(ref.logits[:compared] - got.logits[:compared]))) if steps else 0.0
    status = "passed" if matched == steps else "diverged"
    reason = None if status == "passed" else f"greedy tokens differ from step {matched}"
    return Verification(status, steps, compute, matched, diff, reason)
