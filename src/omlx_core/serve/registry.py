"""The models a server can serve: loaded at start (`--model`, pinned) or on first request.

Least-recently-used unpinned models are unloaded when the memory guard needs room. Loading
happens on the engine thread, so all MLX work stays on one thread.
"""

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omlx_core.models.checkpoint import read_text_config
from omlx_core.models.fingerprint import model_fingerprint
from omlx_core.models.load import load_model
from omlx_core.models.resolve import DEFAULT, ModelRef, list_model_names, locate, resolve
from omlx_core.settings import load_settings


@dataclass
class LoadedModel:
    ref: ModelRef
    model: object
    tokenizer: object
    fingerprint: str
    settings: object
    kv: object  # memory.kv.KVProfile
    weights_bytes: int
    lanes: object  # prefill.install.LaneReport
    kernels: object  # kernels.registry.KernelReport
    context_length: int
    vocab_size: int
    pinned: bool
    last_used: float = field(default_factory=time.monotonic)
    prompt_cache: object = None  # prompt_cache.tiered.TieredPromptCache of this model
    generator: object = None  # mlx-lm BatchGenerator, made by the engine on first use
    stop_sequences: object = None  # EOS ids as mlx-lm StopSequences, made with it
    no_stop: object = None  # no EOS at all, for requests with ignore_eos
    prefill_batching: object = None  # the generator's PrefillBatching, made with it
    prefill_tokens: int = 0  # server.prefill_tokens resolved (engine.prefill_tokens), with it
    decode_sizes: set = field(default_factory=set)  # batch sizes its generator has decoded
    dense_copy: object = None  # decode.dense_copy.DenseCopyReport

    @property
    def id(self) -> str:
        return self.ref.name


def _context_length(config: dict, tokenizer) -> int:
    for key in ("max_position_embeddings", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return int(getattr(tokenizer, "model_max_length", 0) or 4096)


class ModelRegistry:
    def __init__(self, home: Path, startup: list[str], guard, cli_settings: dict | None = None):
        self.home = home
        self.guard = guard
        self.cli_settings = cli_settings or {}
        self.busy: Callable[[], set[str]] = set  # ids of models with running requests (the engine's)
        self.startup = [locate(name, home) for name in startup]  # fail fast on a bad --model
        self.loaded: dict[str, LoadedModel] = {}

    @property
    def default_id(self) -> str:
        return self.startup[0].name

    def available(self) -> list[str]:
        """Ids a request may name: startup models, loaded ones, and models under $OMLX_HOME."""
        names = [ref.name for ref in self.startup] + list(self.loaded) + list_model_names(self.home)
        return list(dict.fromkeys(names))

    def canonical(self, requested: str | None) -> str | None:
        """The model id for a request's `model` field, or None if it cannot be served."""
        if requested is None:
            return self.default_id
        if requested == DEFAULT:
            return locate(DEFAULT, self.home).name
        for ref in self.startup:
            if requested in (ref.name, str(ref.path)):
                return ref.name
        return requested if requested in self.available() else None

    def loaded_now(self, model_id: str) -> LoadedModel | None:
        """The model if it is loaded, marked used; None otherwise. Any thread may ask (one
        dict read): a request for a loaded model need not wait for the engine's step to end
        (`get`, which may load, runs on the engine thread only)."""
        loaded = self.loaded.get(model_id)
        if loaded is not None:
            loaded.last_used = time.monotonic()
        return loaded

    def get(self, model_id: str) -> LoadedModel:
        """The loaded model, loading it now if needed (engine thread only)."""
        loaded = self.loaded.get(model_id)
        if loaded is None:
            pinned = any(ref.name == model_id for ref in self.startup)
            ref = next((r for r in self.startup if r.name == model_id), None) or locate(model_id, self.home)
            self._make_room_for(ref)
            loaded = self._load(ref, pinned)
        loaded.last_used = time.monotonic()
        return loaded

    def _make_room_for(self, ref: ModelRef) -> None:
        """Unload idle unpinned models, least recently used first, until `ref`'s weights fit."""
        from omlx_core.memory.guard import MemoryRefused
        from omlx_core.models.checkpoint import weight_files

        needed = sum(f.stat().st_size for f in weight_files(ref.path)) if ref.path.is_dir() else 0
        while needed > self.guard.available_bytes():
            if not self.evict_one(self.busy()):
                raise MemoryRefused(f"load of {ref.name}", needed, self.guard.available_bytes(),
                                    self.guard.hard_bytes)

    def _load(self, ref: ModelRef, pinned: bool) -> LoadedModel:
        from omlx_core.memory.kv import kv_profile
        from omlx_core.memory.weights import weights_bytes
        from omlx_core.models.clone_fp16 import is_fp16_clone
        from omlx_core.kernels.registry import install_kernels
        from omlx_core.decode.dense_copy import install_dense_copy
        from omlx_core.prefill.install import install_prefill
        from omlx_core.prompt_cache.tiered import open_prompt_cache

        ref = resolve(ref.name if ref.embedded else str(ref.path), self.home)
        settings = load_settings(self.home, ref.key, cli=self.cli_settings)
        model, tokenizer = load_model(ref)
        config = read_text_config(ref.path)
        size = weights_bytes(model)
        self.guard.register_weights(ref.name, size)
        fingerprint = model_fingerprint(ref.path)
        kernels = install_kernels(model, fingerprint, settings)
        lanes = install_prefill(model, settings, fp16_clone=is_fp16_clone(ref.path),
                              warmup_tokens=int(settings["prefill.split_min_tokens"]), kernels=kernels)
        if lanes.extra_bytes:
            self.guard.register_extra(f"prefill_lanes:{ref.name}", lanes.extra_bytes)
        dense_copy = install_dense_copy(model, settings)
        if dense_copy.extra_bytes:
            self.guard.register_extra(f"dense_copy:{ref.name}", dense_copy.extra_bytes)
        loaded = LoadedModel(
            ref=ref, model=model, tokenizer=tokenizer, fingerprint=fingerprint,
            settings=settings, kv=kv_profile(model), weights_bytes=size, lanes=lanes,
            kernels=kernels, dense_copy=dense_copy,
            context_length=_context_length(config, tokenizer),
            vocab_size=int(config.get("vocab_size") or len(tokenizer)), pinned=pinned,
            prompt_cache=open_prompt_cache(model, ref.path, fingerprint, self.home, settings,
                                           self.guard.total_bytes),
        )
        self.loaded[ref.name] = loaded
        return loaded

    def evict_one(self, busy: set[str]) -> bool:
        """Unload the least recently used unpinned idle model; True if one was unloaded."""
        idle = [m for m in self.loaded.values() if not m.pinned and m.id not in busy]
        if not idle:
            return False
        victim = min(idle, key=lambda m: m.last_used)
        del self.loaded[victim.id]
        self.guard.release_weights(victim.id)
        self.guard.release_extra(f"prefix_cache:{victim.id}")
        self.guard.release_extra(f"prefill_lanes:{victim.id}")
        self.guard.release_extra(f"dense_copy:{victim.id}")
        if victim.generator is not None:
            victim.generator.close()
        victim.prompt_cache.close(timeout=None)  # pending writes finish in the background
        del victim
        gc.collect()
        import mlx.core as mx

        mx.clear_cache()
        return True
