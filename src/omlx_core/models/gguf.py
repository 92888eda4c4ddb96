"""Import a GGUF file as an MLX checkpoint directory that mlx-lm loads.

GGUF is how many small models ship (our real test model among them). MLX reads
GGUF tensors itself and turns Q4_0/Q4_1/Q8_0 blocks into its own affine
quantization (group size 32), so importing needs no dequantize/requantize: it
checks the header, renames tensors to mlx-lm's names, undoes llama.cpp's rotary
row permutation, writes a config from the metadata and rebuilds the tokenizer.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from omlx_core.errors import InputError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
SUPPORTED_TOKENIZERS = ("gpt2",)
SHARD_BYTES = 2 * 1024**3

# ---------------------------------------------------------------------------
# Header: parsed in pure Python so a bad file is rejected before any data is read.

_GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
    15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
    26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}
# (elements per block, bytes per block), for the types we import.
_BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18),
           "Q4_1": (32, 20), "Q8_0": (32, 34)}
# GGUF metadata value types: struct format of the scalars; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
            7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass
class _TensorInfo:
    type_name: str
    shape: tuple[int, ...]  # numpy order: GGUF lists the innermost dimension first
    offset: int


@dataclass
class _Header:
    version: int
    data_offset: int
    metadata: dict = field(default_factory=dict)  # scalars and strings; arrays skipped
    tensors: dict[str, _TensorInfo] = field(default_factory=dict)


class _Cursor:
    """Reads little-endian values from the mapped file; running off its end is an error."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise InputError(f"{self.path}: truncated GGUF header")

    def unpack(self, fmt: struct.Struct | str):
        fmt = struct.Struct(fmt) if isinstance(fmt, str) else fmt
        self._need(fmt.size)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def skip_string(self) -> None:
        n = self.unpack(_U64)
        self._need(n)
        self.pos += n

    def string(self) -> str:
        n = self.unpack(_U64)
        self._need(n)
        start, self.pos = self.pos, self.pos + n
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        """One metadata value; arrays are skipped (returned as None) to stay fast."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack(_U32), self.unpack(_U64)
            if etype in _SCALARS:
                n = struct.calcsize(_SCALARS[etype]) * count
                self._need(n)
                self.pos += n
            elif etype == _STRING:
                for _ in range(count):
                    self.skip_string()
            elif etype == _ARRAY:
                for _ in range(count):
                    self.value(_ARRAY)
            else:
                raise InputError(f"{self.path}: bad GGUF metadata array type {etype}")
            return None
        raise InputError(f"{self.path}: bad GGUF metadata value type {vtype}")


def _read_header(path) -> _Header:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 8:
            raise InputError(f"{path}: not a GGUF file (too short)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(_Cursor(buf, path), len(buf))


def _parse_header(cur: _Cursor, file_size: int) -> _Header:
    path = cur.path
    magic = bytes(cur.buf[:4])
    if magic != b"GGUF":
        raise InputError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.unpack(_U32)
    if version not in (2, 3):
        if struct.unpack(">I", struct.pack("<I", version))[0] in (2, 3):
            raise InputError(f"{path}: big-endian GGUF is not supported")
        raise InputError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    n_tensors, n_kv = cur.unpack(_U64), cur.unpack(_U64)

    header = _Header(version=version, data_offset=0)
    for _ in range(n_kv):
        key = cur.string()
        value = cur.value(cur.unpack(_U32))
        if value is not None:
            header.metadata[key] = value

    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack(_U32)
        dims = [cur.unpack(_U64) for _ in range(n_dims)]
        type_id, offset = cur.unpack(_U32), cur.unpack(_U64)
        type_name = _GGML_TYPES.get(type_id, f"type {type_id}")
        header.tensors[name] = _TensorInfo(type_name, tuple(reversed(dims)), offset)

    alignment = int(header.metadata.get("general.alignment", 32)) or 32
    header.data_offset = -(-cur.pos // alignment) * alignment
    for name, info in header.tensors.items():
        if info.type_name not in _BLOCKS:
            continue
        per_block, block_bytes = _BLOCKS[info.type_name]
        nbytes = math.prod(info.shape) // per_block * block_bytes
        if header.data_offset + info.offset + nbytes > file_size:
            raise InputError(f"{path}: truncated GGUF file (data of tensor {name} is cut off)")
    return header


def read_gguf_tensor_types(path) -> dict[str, str]:
    """Tensor name -> ggml type name ("F32", "Q4_1", "Q6_K", ...), from the header only."""
    return {name: info.type_name for name, info in _read_header(path).tensors.items()}


# ---------------------------------------------------------------------------
# Weights: GGUF names -> mlx-lm names, and llama's rotary rows back to HF order.

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_SUFFIXES = ("weight", "bias", "scales", "biases")


def _mlx_name(gguf_name: str) -> str | None:
    module, _, suffix = gguf_name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{suffix}"
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _unpermute_rows(x, n_head: int):
    """Undo llama.cpp's `permute`: rows (head, head_dim/2, 2) -> (head, 2, head_dim/2).

    It is a pure row permutation, so it applies unchanged to packed quantized
    rows and to their scales and biases.
    """
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _convert_weights(path: Path, arch: str, raw: dict, heads: int, kv_heads: int) -> dict:
    weights = {}
    for name, value in raw.items():
        if name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        target = _mlx_name(name)
        if target is None:
            raise InputError(f"{path}: tensor {name} has no place in an mlx-lm {arch} model")
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            n_head = heads if ".attn_q." in name else kv_heads
            if value.shape[0] % (2 * n_head):
                raise InputError(f"{path}: {name} has {value.shape[0]} rows, "
                                 f"not a multiple of 2 x {n_head} heads")
            value = _unpermute_rows(value, n_head)
        weights[target] = value
    return weights


def _quantization(weights: dict) -> dict | None:
    """mlx-lm's quantization config: the common bits, plus per-module exceptions.

    A module that differs gets its own {"group_size", "bits"}; a linear or
    embedding kept in float gets False so no mlx-lm version quantizes it.
    """
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            in_dims = scales.shape[-1] * 32
            bits[module] = weights[f"{module}.weight"].shape[-1] * 32 // in_dims
    if not bits:
        return None
    common = Counter(bits.values()).most_common(1)[0][0]
    config = {"group_size": 32, "bits": common, "mode": "affine"}
    for module, b in sorted(bits.items()):
        if b != common:
            config[module] = {"group_size": 32, "bits": b, "mode": "affine"}
    for name, value in sorted(weights.items()):
        module = name[: -len(".weight")]
        if name.endswith(".weight") and value.ndim == 2 and module not in bits:
            config[module] = False
    return config


# ---------------------------------------------------------------------------
# Config from metadata.

_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _llama3_scaling(path: Path, factors: list[float], base: float, head_dim: int) -> dict:
    """Recover llama3 rope_scaling from llama.cpp's precomputed `rope_freqs` factors.

    llama.cpp stores the factors, not the parameters; we fit the usual
    low/high factors (1, 4) and context 8192 and insist the fit is exact.
    """
    factor = max(factors)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    for i, got in enumerate(factors):
        wavelen = 2 * math.pi * base ** (2 * i / head_dim)
        if wavelen < high_wavelen:
            want = 1.0
        elif wavelen > low_wavelen:
            want = factor
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want = 1 / ((1 - smooth) / factor + smooth)
        if not math.isclose(got, want, rel_tol=1e-3):
            raise InputError(f"{path}: rope_freqs.weight does not match llama3 rope scaling")
    return scaling


def _rope_scaling(path: Path, arch: str, meta: dict) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and f"{arch}.rope.scale_linear" in meta:  # older GGUF key
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        for key, hf_key in (("original_context_length", "original_max_position_embeddings"),
                            ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{key}" in meta:
                scaling[hf_key] = meta[f"{arch}.rope.scaling.{key}"]
        return scaling
    raise InputError(f"{path}: rope scaling type {kind!r} is not supported (linear, yarn)")


def _f32(x) -> float:
    """A float32 metadata value at float32 precision: 1e-05, not 9.999999747378752e-06."""
    return float(f"{float(x):.7g}")


def _number(path: Path, meta: dict, key: str, default=None):
    """A scalar metadata value; missing (without a default) or per-layer lists are errors."""
    value = meta.get(key, default)
    if value is None:
        raise InputError(f"{path}: GGUF metadata lacks {key}")
    if isinstance(value, list):
        raise InputError(f"{path}: per-layer values of {key} are not supported")
    return value


def _heads(path: Path, arch: str, meta: dict) -> tuple[int, int]:
    heads = int(_number(path, meta, f"{arch}.attention.head_count"))
    return heads, int(_number(path, meta, f"{arch}.attention.head_count_kv", heads))


def _config(path: Path, arch: str, meta: dict, weights: dict, rope_freqs) -> dict:
    def need(key, default=None):
        return _number(path, meta, f"{arch}.{key}", default)

    hidden = int(need("embedding_length"))
    heads, kv_heads = _heads(path, arch, meta)
    head_dim = int(need("attention.key_length", hidden // heads))
    rope_dims = int(need("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise InputError(f"{path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    config = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(need("rope.freq_base", 1e6 if arch != "llama" else 1e4)),
        "max_position_embeddings": int(need("context_length", 4096)),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in weights
        config["mlp_bias"] = False
    scaling = _rope_scaling(path, arch, meta)
    if rope_freqs is not None:
        base = config["rope_theta"]
        scaling = _llama3_scaling(path, [float(x) for x in rope_freqs.tolist()], base, head_dim)
    if scaling is not None:
        config["rope_scaling"] = scaling
    quantization = _quantization(weights)
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


# ---------------------------------------------------------------------------
# Tokenizer: rebuild the Hugging Face tokenizer.json from the GGUF vocab.

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "qwen2")
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(path: Path, pre: str):
    """The HF pre-tokenizer that matches llama.cpp's `tokenizer.ggml.pre` (and a normalizer)."""
    from tokenizers import Regex, normalizers, pre_tokenizers as pt

    if pre in ("default", "gpt2"):
        return pt.ByteLevel(add_prefix_space=False, use_regex=True), None
    if pre == "smollm":
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)]), None
    if pre in ("llama-bpe", "qwen2"):
        split = pt.Split(Regex(_LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT),
                         behavior="isolated", invert=False)
        normalizer = normalizers.NFC() if pre == "qwen2" else None
        return pt.Sequence([split, pt.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizer
    raise InputError(f"{path}: tokenizer pre-tokenizer {pre!r} is not supported "
                     f"(supported: {', '.join(_PRE_TOKENIZERS)})")


def _tokenizer_files(path: Path, meta: dict) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json contents for a byte-level BPE vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    if "tokenizer.ggml.tokens" not in meta:
        raise InputError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicated string keeps its first id
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer, normalizer = _pre_tokenizer(path, meta.get("tokenizer.ggml.pre", "default"))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.ByteLevel()

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    named = {k: token(k) for k in ("bos", "eos", "padding", "unknown")}
    special = [t for t, k in zip(tokens, types) if k == _CONTROL]
    special += [t for t in named.values() if t is not None and t not in special]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t not in special]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and named["bos"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and named["eos"] is not None
    if add_bos or add_eos:
        bos, eos = named["bos"], named["eos"]
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        pair = single + " " + " ".join([f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
        ids = [(bos, vocab[bos])] * add_bos + [(eos, vocab[eos])] * add_eos
        tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": named["bos"],
        "eos_token": named["eos"],
        "pad_token": named["padding"],
        "unk_token": named["unknown"],
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    return {"tokenizer.json": json.loads(tokenizer.to_str()), "tokenizer_config.json": tokenizer_config}


# ---------------------------------------------------------------------------
# Writing.

def _save_weights(weights: dict, out: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """model.safetensors, or ~2 GB shards with an index when the weights are larger."""
    import mlx.core as mx

    shards, current, size = [], {}, 0
    for name in sorted(weights):
        nbytes = weights[name].nbytes
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = weights[name]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        mx.save_safetensors(str(out / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / file), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(w.nbytes for w in weights.values())},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _plain(value):
    """MLX returns GGUF metadata numbers as mx.arrays; make them Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _check(path: Path, header: _Header) -> None:
    """Reject what we cannot import from the header alone, before reading any data."""
    arch = header.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InputError(f"{path}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    for name, info in header.tensors.items():
        if info.type_name not in SUPPORTED_TENSOR_TYPES:
            raise InputError(f"{path}: tensor {name} has type {info.type_name}, which is not supported "
                             f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    model = header.metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZERS:
        raise InputError(f"{path}: tokenizer model {model!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_TOKENIZERS)})")
    if "token_embd.weight" not in header.tensors:
        raise InputError(f"{path}: GGUF has no token_embd.weight tensor")


def _write_checkpoint(path: Path, header: _Header, out: Path) -> None:
    import mlx.core as mx

    try:
        raw, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise InputError(f"{path}: MLX could not read the GGUF data ({' '.join(str(e).split())})") from e
    meta = {k: _plain(v) for k, v in meta.items()}
    arch = header.metadata["general.architecture"]
    weights = _convert_weights(path, arch, raw, *_heads(path, arch, meta))
    config = _config(path, arch, meta, weights, raw.get("rope_freqs.weight"))

    files = _tokenizer_files(path, meta)
    eos = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in meta]
    eos = list(dict.fromkeys(eos))
    for key, meta_key in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{meta_key}_token_id" in meta:
            config[key] = meta[f"tokenizer.ggml.{meta_key}_token_id"]
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        files["generation_config.json"] = generation
    files["tokenizer_config.json"]["model_max_length"] = config["max_position_embeddings"]
    files["config.json"] = config

    _save_weights(weights, out)
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False), encoding="utf-8")

    from mlx_lm.utils import load_model

    try:  # the checkpoint must load before it is published; lazy, so nothing is read
        load_model(out, lazy=True)
    except (ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())  # one line, as every error here is
        raise InputError(f"{path}: the converted {arch} checkpoint does not load in mlx-lm ({reason})") from e


def import_gguf(gguf_path: Path, dest: Path) -> Path:
    """Convert `gguf_path` into an mlx-lm checkpoint directory at `dest`; returns `dest`.

    Everything is written to a temporary directory beside `dest` and renamed
    into place only when complete, so a failed import leaves nothing behind.
    """
    gguf_path, dest = Path(gguf_path), Path(dest)
    header = _read_header(gguf_path)
    _check(gguf_path, header)
    if dest.exists():
        raise InputError(f"{dest}: already exists; choose another destination or remove it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        _write_checkpoint(gguf_path, header, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is not
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
