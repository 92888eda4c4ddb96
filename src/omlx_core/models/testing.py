"""Tiny random-weight checkpoints that look like real mlx-lm ones, built in seconds.

Tests and examples need every architecture we patch (llama, the qwen3_5 hybrid with
gated-delta layers, deepseek_v41 with its sparse indexer) without a download. The weights
are random, so the text is noise, but the config, tensor names, shapes, dtypes, shard
files and quantization are what `mlx_lm.convert` writes, so code that reads a real
checkpoint reads these the same way. Every linear has an input width that is a multiple of
64, so 4-bit quantization with group size 32 or 64 covers all of them.
"""

import contextlib
import copy
import importlib
import io
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import get_total_parameters, quantize_model, save_config, save_model

from omlx_core.errors import InputError

ARCHITECTURES = ("llama", "qwen3_5", "deepseek_v41")

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = SPECIAL_TOKENS.index("<|im_end|>")
PAD_TOKEN_ID = SPECIAL_TOKENS.index("<|endoftext|>")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The tokenizer's training text: plain English, so common words become single tokens.
_TEXT = """\
The harbour was quiet in the early morning. Fishing boats rocked gently against the
wooden pier, and the gulls waited on the posts for the first catch of the day. An old
man mended his nets by the water, humming a song his father had taught him long ago.

In the town above the harbour, the baker had been awake since four o'clock. The smell
of fresh bread drifted through the narrow streets, past the closed shutters of the
houses and the empty tables of the cafe. Soon the market would open, and the square
would fill with voices, carts, flowers, fruit and the ringing of the church bell.

A small school stood at the end of the main road. Its teacher, a patient woman with
grey hair and bright eyes, believed that every child could learn to read, to count and
to ask good questions. She told her students that knowledge grows like a garden: slowly,
with care, with water and light, and with the courage to pull out the weeds.

Far beyond the hills, a railway line crossed the valley on a long stone bridge. Twice a
day a train passed over it, carrying letters, machines, travellers and news from the
city. Children ran to the fields to wave at the windows, and sometimes, if they were
lucky, a passenger waved back before the train disappeared into the tunnel.

When evening came, the sky turned orange and then purple. Lamps were lit in the windows,
families gathered for supper, and the sea breathed softly against the shore. Somewhere a
dog barked twice and was silent. The stars appeared one by one, and the town slept,
ready for another ordinary, wonderful day.

Questions are the beginning of science. Why does the moon change its shape? How far away
is the nearest star? What makes the wind blow from the west in winter and from the south
in summer? Each answer opens a door to new questions, and the people who keep asking
them are the ones who build bridges, write books, cure diseases and explore the world.
"""


def _llama_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }


def _qwen3_5_config() -> dict:
    # Qwen3.5 checkpoints nest the text model under text_config, as here. Layers 0-2 are
    # gated-delta (linear attention) layers, layer 3 full attention.
    layers, interval = 4, 4
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": layers,
        "full_attention_interval": interval,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attn_output_gate": True,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [3, 3, 2],
        },
        "max_position_embeddings": 4096,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_TOKEN_ID,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "text_config": text,
    }


def _deepseek_v41_config() -> dict:
    # The released schedule in miniature: two sliding-window-only layers would be [0, 0];
    # here layer 0 only has the window, layers 1-3 pool 2 tokens into one latent (layer 1
    # compresses and indexes, 2-3 reuse it), layer 4 keeps full-resolution shared KV and
    # is the candidate source, layer 6 re-indexes inside its candidate blocks, 5 and 7
    # reuse the top-k of the index source before them.
    text = {
        "model_type": "deepseek_v41_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "q_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "o_groups": 2,
        "o_lora_rank": 64,
        "moe_intermediate_size": 128,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "sliding_window": 16,
        "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1],
        "kv_source_layer_ids": [1, 4],
        "index_source_layer_ids": [1, 4, 6],
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 4,
        "index_n_heads": 4,
        "index_head_dim": 64,
        "index_topk": 8,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 16384,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        # The released 1e-20 underflows to zero in float16, which clone-fp16 produces.
        "rms_norm_eps": 1e-6,
        "engram_layer_ids": [],
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_TOKEN_ID,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "tie_word_embeddings": False,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "text_config": text,
    }


_CONFIGS = {
    "llama": _llama_config,
    "qwen3_5": _qwen3_5_config,
    "deepseek_v41": _deepseek_v41_config,
}


def tiny_config(arch: str) -> dict:
    """The config.json of a float checkpoint of `arch` (a fresh dict each call)."""
    if arch not in _CONFIGS:
        raise InputError(f"unknown tiny architecture {arch!r}; pick one of {ARCHITECTURES}")
    return _CONFIGS[arch]()


def build_tiny_tokenizer(dest: Path, vocab_size: int) -> None:
    """Train a byte-level BPE of exactly `vocab_size` tokens on the built-in text.

    Byte-level, so any text round-trips; ChatML specials first, so their ids are fixed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    smallest = len(SPECIAL_TOKENS) + 256
    if vocab_size < smallest:
        raise InputError(f"a tiny tokenizer has at least {smallest} tokens, not {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TEXT], trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise InputError(
            f"the built-in text yields at most {tokenizer.get_vocab_size()} tokens, "
            f"not {vocab_size}"
        )
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {
                "content": token, "lstrip": False, "normalized": False,
                "rstrip": False, "single_word": False, "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


@contextlib.contextmanager
def _seeded(seed: int):
    """Seed MLX's global generator, which module init draws from.

    MLX cannot restore a saved state, so the caller's stream resumes from a seed drawn
    from it first: still determined by the caller's own seed, never reset to ours.
    """
    resume = mx.random.randint(0, 2**31 - 1, ()).item()
    mx.random.seed(seed)
    try:
        yield
    finally:
        mx.random.seed(resume)


def _make_model(config: dict, seed: int) -> nn.Module:
    """mlx-lm's own Model, from the config as `load` would read it, with random weights.

    mlx-lm initializes the router and hyper-connection matrices of deepseek_v41 to zeros,
    which would make routing and stream mixing ignore the input; they get small random
    values like the other weights.
    """
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    # A deep copy: ModelArgs rewrites nested dicts in place (qwen3_5 renames rope_type).
    with _seeded(seed):
        model = arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(config)))

        def fill_zeros(_, value):
            if value.ndim >= 2 and not mx.any(value).item():
                return 0.02 * mx.random.normal(value.shape, dtype=value.dtype)
            return value

        model.update(tree_map_with_path(fill_zeros, model.parameters()))
        mx.eval(model.parameters())
    return model


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast float parameters as `mlx_lm.convert --dtype` does, honouring cast_predicate."""
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path, value):
        if keep(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))


def _split(weights: dict, shards: int) -> list[dict]:
    """Cut the tensors, in order, into `shards` non-empty runs of about equal bytes."""
    items = list(weights.items())
    if shards > len(items):
        raise InputError(f"shards must be at most {len(items)} (one per tensor), not {shards}")
    total = sum(value.nbytes for _, value in items)
    parts, done = [{}], 0
    for i, (key, value) in enumerate(items):
        shards_left = shards - len(parts)
        full = done + value.nbytes / 2 > total * len(parts) / shards
        if parts[-1] and shards_left and (full or len(items) - i == shards_left):
            parts.append({})
        parts[-1][key] = value
        done += value.nbytes
    return parts


def _save_shards(dest: Path, model: nn.Module, shards: int) -> None:
    """Write N shards and their index the way `mlx_lm.utils.save_model` does.

    save_model shards only at its fixed 5 GB limit, so a tiny model always gets one file.
    """
    weights = dict(tree_flatten(model.parameters()))
    weight_map = {}
    parts = _split(weights, shards)
    for i, part in enumerate(parts, start=1):
        name = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        mx.save_safetensors(str(dest / name), part, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(part, name))
    index = {
        "metadata": {
            "total_size": sum(value.nbytes for value in weights.values()),
            "total_parameters": get_total_parameters(model),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(dest / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)


def _reshape(text: dict, shape: dict) -> None:
    """Apply shape overrides to a (text) config, keeping the layer pattern consistent."""
    text.update({key: value for key, value in shape.items() if key != "vocab_size"})
    if "layer_types" in text and len(text["layer_types"]) != text["num_hidden_layers"]:
        interval = text.get("full_attention_interval", 4)
        text["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(text["num_hidden_layers"])]


def build_tiny_model(
    arch: str,
    dest: Path,
    *,
    quantized: bool = False,
    bits: int = 4,
    group_size: int = 32,
    shards: int = 1,
    dtype: str = "bfloat16",
    seed: int = 0,
    shape: dict | None = None,
) -> Path:
    """Write a random checkpoint of `arch` to `dest` (new or empty) and return its path.

    `shape` overrides config keys, e.g. a real model's hidden size and layer count for a
    benchmark-sized checkpoint; the vocabulary stays the tiny tokenizer's.
    The same arguments give the same bytes. Loads with `mlx_lm.utils.load(str(dest))`.
    """
    config = tiny_config(arch)
    _reshape(config.get("text_config", config), shape or {})
    float_type = getattr(mx, dtype, None)
    if not isinstance(float_type, mx.Dtype) or not mx.issubdtype(float_type, mx.floating):
        raise InputError(f"dtype must be a float type such as bfloat16, not {dtype!r}")
    if shards < 1:
        raise InputError(f"shards must be at least 1, not {shards}")
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise InputError(f"{dest} is not empty; build a tiny model into a new directory")
    dest.mkdir(parents=True, exist_ok=True)

    config["torch_dtype"] = dtype
    model = _make_model(config, seed)
    _cast(model, float_type)
    if quantized:
        # quantize_model prints a summary; keep stdout clean for `--json` callers.
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, bits)

    if shards == 1:
        save_model(dest, model)
    else:
        _save_shards(dest, model, shards)
    save_config(config, config_path=dest / "config.json")
    text = config.get("text_config", config)
    build_tiny_tokenizer(dest, text["vocab_size"])
    return dest
