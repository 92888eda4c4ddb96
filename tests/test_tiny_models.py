"""Tiny checkpoints load, generate, shard, quantize and repeat like real ones."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never ask a hub

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from omlx_core.errors import InputError
from omlx_core.models.testing import (
    ARCHITECTURES,
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_config,
)

VARIANTS = ("float", "q4")
GEN_TOKENS = 6
MESSAGES = [{"role": "user", "content": "Tell me about the harbour in the morning, please."}]


def float_dtype(arch: str) -> str:
    # MLX's CPU GatherMM, which deepseek_v41's routed experts use, runs only float32.
    if arch == "deepseek_v41" and mx.default_device() == mx.cpu:
        return "float32"
    return "bfloat16"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """build(arch, variant, shards=1, seed=0, dtype=None): each checkpoint built once."""
    cache = {}

    def build(arch, variant, shards=1, seed=0, dtype=None):
        dtype = dtype or (float_dtype(arch) if variant == "float" else "bfloat16")
        key = (arch, variant, shards, seed, dtype)
        if key not in cache:
            dest = tmp_path_factory.mktemp(f"{arch}-{variant}-{shards}-{seed}-{dtype}")
            cache[key] = build_tiny_model(
                arch, dest, quantized=variant == "q4", shards=shards, seed=seed, dtype=dtype
            )
        return cache[key]

    return build


def chat_prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    return tokenizer.encode(text, add_special_tokens=False)


def file_tensors(path) -> dict:
    weights = {}
    for file in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(file)))
    return weights


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_loads_and_generates_exactly_n_tokens(built, arch, variant, shards):
    model, tokenizer = load(str(built(arch, variant, shards)))
    prompt = chat_prompt(tokenizer)

    logits = model(mx.array([prompt]))
    assert logits.shape == (1, len(prompt), VOCAB_SIZE)
    assert mx.all(mx.isfinite(logits)).item()

    # generate_step ignores EOS, so max_tokens is the exact count.
    steps = list(generate_step(mx.array(prompt), model, max_tokens=GEN_TOKENS))
    assert len(steps) == GEN_TOKENS
    for token, logprobs in steps:
        assert 0 <= int(token) < VOCAB_SIZE
        assert mx.all(mx.isfinite(logprobs)).item()
    assert isinstance(tokenizer.decode([int(t) for t, _ in steps]), str)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quantized_variant_is_quantized(built, arch):
    path = built(arch, "q4")
    model, _ = load(str(path))
    modules = [m for _, m in model.named_modules()]
    assert any(isinstance(m, nn.QuantizedLinear) for m in modules)
    # Every linear of the tiny shapes quantizes: none stays dense.
    assert not any(type(m) is nn.Linear for m in modules)
    config = json.loads((path / "config.json").read_text())
    expected = {"group_size": 32, "bits": 4, "mode": "affine"}
    assert config["quantization"] == expected
    assert config["quantization_config"] == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_float_variant_has_requested_dtype(built, arch, dtype):
    path = built(arch, "float", dtype=dtype)
    model, _ = load(str(path))
    keep = getattr(model, "cast_predicate", lambda _: True)
    for name, value in tree_flatten(model.parameters()):
        assert value.dtype == (getattr(mx, dtype) if keep(name) else mx.float32), name
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    config = json.loads((path / "config.json").read_text())
    assert "quantization" not in config
    assert config["torch_dtype"] == dtype


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_three_shards_hold_the_single_shard_weights(built, arch, variant):
    path = built(arch, variant, shards=3)
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in path.glob("model*.safetensors")) == names

    index = json.loads((path / "model.safetensors.index.json").read_text())
    per_file = {name: mx.load(str(path / name)) for name in names}
    assert index["weight_map"] == {k: name for name, ws in per_file.items() for k in ws}
    tensors = file_tensors(path)
    total = sum(v.nbytes for v in tensors.values())
    assert index["metadata"]["total_size"] == total
    largest = max(v.nbytes for v in tensors.values())
    for weights in per_file.values():
        assert abs(sum(v.nbytes for v in weights.values()) - total / 3) <= largest

    single = file_tensors(built(arch, variant, shards=1))
    assert tensors.keys() == single.keys()
    assert all(mx.array_equal(tensors[k], single[k]).item() for k in single)
    sharded_model, _ = load(str(path))
    single_model, _ = load(str(built(arch, variant, shards=1)))
    loaded = dict(tree_flatten(single_model.parameters()))
    for name, value in tree_flatten(sharded_model.parameters()):
        assert mx.array_equal(value, loaded[name]).item(), name


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_same_seed_same_bytes_other_seed_other_weights(built, arch, tmp_path):
    first = built(arch, "q4")
    again = build_tiny_model(arch, tmp_path / "again", quantized=True)
    for file in sorted(first.iterdir()):
        assert (again / file.name).read_bytes() == file.read_bytes(), file.name

    other = file_tensors(built(arch, "q4", seed=1))
    weights = file_tensors(first)
    assert other.keys() == weights.keys()
    differ = [k for k in weights if not mx.array_equal(weights[k], other[k]).item()]
    # Norms start at one whatever the seed; the linear weights do not.
    assert any(k.endswith("lm_head.weight") for k in differ)
    assert len(differ) > len(weights) // 2


def test_tokenizer_round_trips_and_renders_chatml(tmp_path):
    from transformers import AutoTokenizer
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    build_tiny_tokenizer(tmp_path, 300)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert len(hf) == 300
    assert hf.eos_token == "<|im_end|>" and hf.eos_token_id == EOS_TOKEN_ID
    assert hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"]) == [0, 1]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "chat_template" in config

    wrapped = load_tokenizer(tmp_path)
    text = "Fresh bread, 42 boats & ünïcödé — the harbour at dawn.\n\tSpaces  too."
    for tokenizer in (hf, wrapped):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
        rendered = tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=False
        )
        assert rendered == (
            f"<|im_start|>user\n{MESSAGES[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
        )
    assert wrapped.eos_token_ids == {EOS_TOKEN_ID}
    assert wrapped.encode("<|im_start|>", add_special_tokens=False) == [1]


def test_tokenizer_size_is_exact_or_refused(tmp_path):
    from tokenizers import Tokenizer

    build_tiny_tokenizer(tmp_path / "a", VOCAB_SIZE)
    assert Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json")).get_vocab_size() == 512
    with pytest.raises(InputError, match="at least 259"):
        build_tiny_tokenizer(tmp_path / "b", 100)
    with pytest.raises(InputError, match="at most"):
        build_tiny_tokenizer(tmp_path / "c", 100_000)


def test_qwen3_5_is_the_hybrid_gated_delta_model(built):
    config = tiny_config("qwen3_5")
    text = config["text_config"]
    assert config["model_type"] == "qwen3_5" and text["full_attention_interval"] == 4
    model, _ = load(str(built("qwen3_5", "q4")))
    assert [layer.is_linear for layer in model.layers] == [True, True, True, False]
    modules = dict(model.named_modules())
    qkv = modules["language_model.model.layers.0.linear_attn.in_proj_qkv"]
    key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value_dim = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    assert isinstance(qkv, nn.QuantizedLinear)
    assert qkv.weight.shape[0] == 2 * key_dim + value_dim
    assert "language_model.model.layers.3.self_attn.q_proj" in modules
    assert "language_model.model.layers.0.mlp.gate_proj" in modules


def test_deepseek_v41_runs_its_indexer(built):
    text = tiny_config("deepseek_v41")["text_config"]
    model, tokenizer = load(str(built("deepseek_v41", "q4")))
    modules = dict(model.named_modules())
    indexers = sorted(n for n in modules if n.endswith("self_attn.indexer"))
    assert indexers == [f"model.layers.{i}.self_attn.indexer" for i in (1, 4, 6)]

    prompt = chat_prompt(tokenizer)
    assert len(prompt) > text["sliding_window"]  # the window evicts, the indexer matters
    cache = model.make_cache()
    mx.eval(model(mx.array([prompt]), cache=cache))
    # The kv+index sources keep index keys: one per pooled group at ratio 2, per token at 1.
    width = text["index_head_dim"]
    assert cache[1].index_k.shape == (1, len(prompt) // 2, width)
    assert cache[4].index_k.shape == (1, len(prompt), width)
    assert len(prompt) // 2 > text["index_topk"]  # so top-k really selects


def test_bad_requests_are_refused(tmp_path):
    with pytest.raises(InputError, match="unknown tiny architecture"):
        tiny_config("gpt2")
    with pytest.raises(InputError, match="dtype"):
        build_tiny_model("llama", tmp_path / "a", dtype="int8")
    with pytest.raises(InputError, match="shards"):
        build_tiny_model("llama", tmp_path / "b", shards=0)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="not empty"):
        build_tiny_model("llama", tmp_path / "c")
