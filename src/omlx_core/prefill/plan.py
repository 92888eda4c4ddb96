"""The split plan: which projections are split, and which output channels each lane computes.

Targets, per layer: the MLP gate and up projections (`mlp_gate_up`), the MLP down
projection (`mlp_down`) and, in hybrid models, the gated-delta layer's qkv projection
(`gdn_qkv`). A plan gives each target kind a share of output channels per non-gpu lane;
a lane's slice is rounded down to its alignment and the rest (always the leading rows)
stays on `gpu`, so slices are contiguous: gpu rows first, then cpu, then ane.

GDN structural floor: the qkv projection's outputs are read back per head (qwen3_5:
q | k | v; qwen3_next: per key-head groups of q, k, v and z). A slice that is not a
whole number of the smallest such unit is legal arithmetic but useless to a lane that
works per head, so a GDN share below the floor is rounded up to it or to nothing.
"""

import math
from dataclasses import dataclass, field

import mlx.nn as nn

from omlx_core.errors import InputError

TARGET_KINDS = ("mlp_gate_up", "mlp_down", "gdn_qkv")
SPLIT_LANES = ("cpu", "ane")  # lanes that take a share; gpu keeps the rest
ALIGNMENT = {"gpu": 128, "ane": 64, "cpu": 64}

_SUFFIXES = {
    ".mlp.gate_proj": "mlp_gate_up", ".mlp.up_proj": "mlp_gate_up", ".mlp.down_proj": "mlp_down",
    ".in_proj_qkv": "gdn_qkv", ".in_proj_qkvz": "gdn_qkv",  # inside a .linear_attn. layer
}


@dataclass(frozen=True)
class Target:
    path: str  # the module's name in the model, e.g. model.layers.3.mlp.down_proj
    kind: str
    out_features: int
    in_features: int
    floor: int = 0  # smallest useful slice (GDN), 0 when any aligned slice works


@dataclass(frozen=True)
class Slice:
    lane: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SplitPlan:
    shares: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> lane -> share

    def __post_init__(self):
        for kind, lanes in self.shares.items():
            if kind not in TARGET_KINDS:
                raise InputError(f"split plan: unknown target kind {kind!r}; use {', '.join(TARGET_KINDS)}")
            for lane, share in lanes.items():
                if lane not in SPLIT_LANES:
                    raise InputError(f"split plan: lane {lane!r} takes no share; use {', '.join(SPLIT_LANES)}")
                if not 0.0 <= share <= 1.0:
                    raise InputError(f"split plan: {kind} share {share} for {lane} is not in [0, 1]")
            if sum(lanes.values()) > 1.0 + 1e-9:
                raise InputError(f"split plan: {kind} shares add up to more than 1")

    def slices(self, target: Target) -> list[Slice]:
        """The lanes' contiguous output-channel ranges for one target; empty lanes left out."""
        sizes = {}
        for lane in SPLIT_LANES:
            share = self.shares.get(target.kind, {}).get(lane, 0.0)
            size = aligned(int(target.out_features * share), ALIGNMENT[lane])
            if target.floor and 0 < size:
                size = max(target.floor, size // target.floor * target.floor)
            sizes[lane] = size
        while sum(sizes.values()) > target.out_features:  # rounding up to the floor overshot
            lane = max(sizes, key=sizes.get)
            sizes[lane] -= target.floor or ALIGNMENT[lane]
        gpu = target.out_features - sum(sizes.values())
        ranges, start = [], 0
        for lane, size in [("gpu", gpu)] + [(lane, sizes[lane]) for lane in SPLIT_LANES]:
            if size > 0:
                ranges.append(Slice(lane, start, start + size))
                start += size
        return ranges


def aligned(channels: int, alignment: int) -> int:
    return channels // alignment * alignment


def _linear_shape(module) -> tuple[int, int] | None:
    from omlx_core.prefill.fast_paths import unwrap

    module = unwrap(module)
    if isinstance(module, nn.QuantizedLinear):
        out_features, packed = module.weight.shape
        return out_features, packed * 32 // module.bits
    if isinstance(module, nn.Linear):
        return tuple(module.weight.shape)
    return None


def gdn_floor(model, path: str) -> int:
    """The smallest aligned qkv slice that keeps whole heads (and z outputs) together."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None) or args
    get = (lambda key: text.get(key)) if isinstance(text, dict) else (lambda key: getattr(text, key, None))
    head_k, head_v = get("linear_key_head_dim"), get("linear_value_head_dim")
    heads_k, heads_v = get("linear_num_key_heads"), get("linear_num_value_heads")
    if not all((head_k, head_v, heads_k, heads_v)):
        return ALIGNMENT["cpu"]
    if path.endswith("in_proj_qkvz"):  # per key-head group: q, k, then v and z of its value heads
        unit = 2 * head_k + 2 * head_v * (heads_v // heads_k)
    else:  # q | k | v in blocks: a whole value head is the smallest piece read back
        unit = math.gcd(head_k, head_v)
    return math.lcm(unit, ALIGNMENT["cpu"])


def find_targets(model) -> list[Target]:
    """Every split target in the model, in module order."""
    targets = []
    for path, module in model.named_modules():
        kind = next((k for suffix, k in _SUFFIXES.items() if path.endswith(suffix)), None)
        if kind == "gdn_qkv" and ".linear_attn." not in path:
            kind = None
        shape = _linear_shape(module) if kind else None
        if shape is None:
            continue
        floor = gdn_floor(model, path) if kind == "gdn_qkv" else 0
        targets.append(Target(path, kind, shape[0], shape[1], floor))
    return targets
