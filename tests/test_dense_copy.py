"""The dense copy's backend plans: float32 for every input on MLX's CPU backend (the tied
head included), the scales' dtype for decode sizes elsewhere; auto's conditions."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load

from omlx_core.blas import blas_state
from omlx_core.decode.dense_copy import DenseCopyEmbedding, DenseCopyLinear, install_dense_copy
from omlx_core.models.testing import build_tiny_model
from omlx_core.settings import load_settings

ON = {"compute.dense_copy": "on"}


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tied") / "llama", quantized=True,
                            shape={"tie_word_embeddings": True})


def quantized_layers(model) -> dict:
    return {path: module for path, module in model.named_modules()
            if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


def test_cpu_copy_is_float32_and_computes_every_input_as_the_dequantized_product(tied):
    model, _ = load(str(tied))
    originals = quantized_layers(model)
    report = install_dense_copy(model, ON, backend="cpu")
    copies = {path: module for path, module in model.named_modules()
              if isinstance(module, (DenseCopyLinear, DenseCopyEmbedding))}
    assert set(copies) == set(originals) and report.max_tokens and report.as_dict()["max_tokens"] is None
    assert report.extra_bytes == sum(m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits * 4
                                     for m in originals.values())
    for path, layer in copies.items():
        original = originals[path]
        assert layer._dense.dtype == mx.float32
        weight = mx.dequantize(original.weight, original.scales, original.biases, group_size=original.group_size,
                               bits=original.bits, dtype=mx.float32)
        x = mx.random.normal((1, 300, weight.shape[1]), key=mx.random.key(1)).astype(mx.bfloat16)  # prefill size
        product = layer.as_linear(x) if isinstance(layer, DenseCopyEmbedding) else layer(x)
        want = x.astype(mx.float32) @ weight.T
        if "bias" in original:
            want = want + original.bias
        assert product.dtype == x.dtype  # a 16-bit input comes back 16-bit
        # Within bf16 rounding of the exact product, and no farther from it than MLX's quantized path.
        reference = original.as_linear(x) if isinstance(original, nn.QuantizedEmbedding) else original(x)
        ours = float(mx.abs(product.astype(mx.float32) - want).max())
        theirs = float(mx.abs(reference.astype(mx.float32) - want).max())
        assert ours <= max(theirs, 2**-8 * float(mx.abs(want).max())), path
    head = copies["model.embed_tokens"]
    ids = mx.array([[1, 5, 9]])
    assert mx.array_equal(head(ids), originals["model.embed_tokens"](ids))  # lookups read the packed table
    assert head.calls == 1 and all(layer.calls == 1 for layer in copies.values())


def test_cpu_copy_generates_what_the_dequantized_model_generates(tied):
    from mlx_lm.generate import generate_step

    def greedy(model):
        return [int(t) for t, _ in generate_step(mx.array([3, 14, 15, 92, 65], dtype=mx.int32), model,
                                                 max_tokens=24)]

    copied, _ = load(str(tied))
    install_dense_copy(copied, ON, backend="cpu")
    reference, _ = load(str(tied))
    for path, module in quantized_layers(reference).items():
        dense = mx.dequantize(module.weight, module.scales, module.biases, group_size=module.group_size,
                              bits=module.bits, dtype=mx.float32)
        if isinstance(module, nn.QuantizedEmbedding):
            continue  # the head: mlx-lm multiplies the embedding; checked through the copy above
        linear = nn.Linear(1, 1, bias="bias" in module)
        linear.weight = dense
        if "bias" in module:
            linear.bias = module.bias
        *parents, last = path.split(".")
        owner = reference
        for part in parents:
            owner = owner[int(part)] if isinstance(owner, list) else getattr(owner, part)
        setattr(owner, last, linear) if not isinstance(owner, list) else owner.__setitem__(int(last), linear)
    out_copied, out_reference = greedy(copied), greedy(reference)
    assert len(out_copied) == 24
    assert out_copied[:8] == out_reference[:8]


def test_auto_needs_the_cpu_backend_an_optimized_blas_and_room(tied, home):
    settings = load_settings(home)
    assert settings["compute.dense_copy"] == "auto"
    model, _ = load(str(tied))
    cuda = install_dense_copy(model, settings, backend="cuda")
    assert not cuda.layers and "auto" in cuda.reason
    crowded = install_dense_copy(model, settings, backend="cpu", total_memory=1 << 20)
    if blas_state().loaded:
        assert not crowded.layers and "over 25% of memory" in crowded.reason
        roomy = install_dense_copy(model, settings, backend="cpu", total_memory=1 << 40)
        assert roomy.layers and "float32 copy" in roomy.reason
    else:
        assert not crowded.layers and blas_state().reason in crowded.reason
    forced, _ = load(str(tied))
    assert install_dense_copy(forced, ON, backend="cpu", total_memory=1 << 20).layers  # on ignores room


def test_off_leaves_the_model_alone(tied):
    model, _ = load(str(tied))
    before = quantized_layers(model)
    report = install_dense_copy(model, {"compute.dense_copy": "off"}, backend="cpu")
    assert not report.layers and report.extra_bytes == 0 and quantized_layers(model) == before


def test_split_lanes_slice_the_copy_instead_of_making_it_again(tied):
    from omlx_core.prefill.split import rows_of

    model, _ = load(str(tied))
    install_dense_copy(model, ON, backend="cpu")
    layer = next(m for _, m in model.named_modules() if isinstance(m, DenseCopyLinear))
    part = rows_of(layer, 8, 24)
    assert isinstance(part, DenseCopyLinear) and part._dense.shape[0] == 16
    x = mx.random.normal((1, 40, layer._dense.shape[1]), key=mx.random.key(4))
    assert mx.allclose(part(x), layer(x)[..., 8:24], atol=1e-5)
