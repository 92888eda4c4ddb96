"""`omlx clone-fp16`: fp16 floats, packed weights untouched, verified, never half-written."""

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never ask a hub

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

import omlx_core
from omlx_core.errors import InputError, OmlxError
from omlx_core.models import CloneReport, clone_fp16, is_fp16_clone
from omlx_core.models.fingerprint import model_fingerprint
from omlx_core.models.resolve import resolve
from omlx_core.models.testing import build_tiny_model
from omlx_core.models.verify import compare_greedy

from conftest import omlx_env, run_omlx

FLOATS = ("BF16", "F16", "F32", "F64")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(arch="llama", quantized=False, shards=1, dtype="bfloat16"): each built once."""
    cache = {}

    def build(arch="llama", quantized=False, shards=1, dtype="bfloat16"):
        key = (arch, quantized, shards, dtype)
        if key not in cache:
            dest = tmp_path_factory.mktemp(f"{arch}-{'q4' if quantized else dtype}-{shards}")
            cache[key] = build_tiny_model(arch, dest / "model", quantized=quantized,
                                          shards=shards, dtype=dtype)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """The embedded SmolLM2, imported from its GGUF once for the whole session."""
    home = tmp_path_factory.mktemp("default-home")
    return resolve("default", home)


def hashes(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def raw_tensors(path: Path) -> dict[str, tuple[str, list, bytes, str]]:
    """name -> (dtype, shape, raw bytes, shard file), read straight from the headers."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        data = file.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        header.pop("__metadata__", None)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            tensors[name] = (info["dtype"], info["shape"],
                             data[8 + length + begin:8 + length + end], file.name)
    return tensors


def metadata(file: Path) -> dict:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]).get("__metadata__")


def leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def assert_faithful_clone(src: Path, dst: Path) -> None:
    """Floats are exactly mx's fp16 cast of the source; everything else byte-identical."""
    before, after = raw_tensors(src), raw_tensors(dst)
    assert after.keys() == before.keys()
    source_values = {}
    for file in sorted(src.glob("*.safetensors")):
        source_values.update(mx.load(str(file)))
    for name, (dtype, shape, data, shard) in before.items():
        new_dtype, new_shape, new_data, new_shard = after[name]
        assert (new_shape, new_shard) == (shape, shard), name
        if dtype in FLOATS:
            assert new_dtype == "F16", name
            expected = np.array(source_values[name].astype(mx.float16).view(mx.uint16))
            assert np.frombuffer(new_data, np.uint16).tobytes() == expected.tobytes(), name
        else:
            assert (new_dtype, new_data) == (dtype, data), name
    for file in src.glob("*.safetensors"):
        assert metadata(dst / file.name) == metadata(file) == {"format": "mlx"}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()


def assert_loads_and_generates(path: Path, tokens: int = 4) -> None:
    model, tokenizer = load(str(path))
    assert is_fp16_clone(model)
    prompt = mx.array(tokenizer.encode("The harbour was quiet"))
    steps = list(generate_step(prompt, model, max_tokens=tokens))
    assert len(steps) == tokens
    assert all(mx.all(mx.isfinite(logprobs)).item() for _, logprobs in steps)


def test_bf16_clone_through_the_cli(tiny, home, tmp_path):
    src = tiny("llama")
    source_hashes = hashes(src)
    dst = tmp_path / "clone"

    result = run_omlx(home, "clone-fp16", str(src), str(dst), "--json", "--verify-tokens", "8")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tensors_converted"] == len(raw_tensors(src)) and report["tensors_copied"] == 0
    assert report["bytes_read"] == sum(len(t[2]) for t in raw_tensors(src).values())
    assert report["verification"]["status"] == "passed"
    assert report["verification"]["tokens_matched"] == 8
    assert report["verification"]["max_abs_logit_diff"] < 0.1
    assert report["elapsed_s"] > 0 and report["clamped"] == 0

    assert hashes(src) == source_hashes
    assert_faithful_clone(src, dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["torch_dtype"] == "float16"
    assert config["omlx"]["source_fingerprint"] == model_fingerprint(src) == report["source_fingerprint"]
    assert config["omlx"]["omlx_version"] == omlx_core.__version__
    datetime.fromisoformat(config["omlx"]["converted_at"])
    assert is_fp16_clone(dst) and is_fp16_clone(str(dst)) and is_fp16_clone(resolve(str(dst), home))
    assert not is_fp16_clone(src)
    assert_loads_and_generates(dst)
    assert leftovers(dst) == []


def test_quantized_clone_keeps_packed_weights_and_converts_scales(tiny, tmp_path):
    src = tiny("llama", quantized=True)
    source_hashes = hashes(src)
    dst = tmp_path / "clone"

    report = clone_fp16(src, dst, verify_tokens=8)
    assert isinstance(report, CloneReport)
    before = raw_tensors(src)
    packed = [name for name, t in before.items() if t[0] == "U32"]
    assert packed and all(name.endswith(".weight") for name in packed)
    assert {before[n.removesuffix("weight") + "scales"][0] for n in packed} == {"BF16"}
    assert report.tensors_copied == len(packed)
    assert report.tensors_converted == len(before) - len(packed)
    assert report.verification["status"] in ("passed", "diverged")
    assert report.verification["max_abs_logit_diff"] < 0.5

    assert hashes(src) == source_hashes
    assert_faithful_clone(src, dst)  # packed weights byte-identical, scales/biases fp16
    source_config = json.loads((src / "config.json").read_text())
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"] == source_config["quantization"]
    assert_loads_and_generates(dst)


def test_three_shards_keep_their_layout_and_index(tiny, tmp_path):
    src = tiny("llama", shards=3)
    source_hashes = hashes(src)
    dst = tmp_path / "clone"

    report = clone_fp16(src, dst, verify_tokens=4)
    assert report.shards == 3
    assert sorted(p.name for p in dst.glob("*.safetensors")) == \
        sorted(p.name for p in src.glob("*.safetensors"))
    assert_faithful_clone(src, dst)  # every tensor stays in its shard
    source_index = json.loads((src / "model.safetensors.index.json").read_text())
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == source_index["weight_map"]
    assert index["metadata"]["total_size"] == sum(len(t[2]) for t in raw_tensors(dst).values())
    assert index["metadata"]["total_parameters"] == source_index["metadata"]["total_parameters"]
    assert hashes(src) == source_hashes
    assert_loads_and_generates(dst)


def _poke_float32(src: Path, name: str, values: list[float]) -> None:
    """Overwrite the first elements of one float32 tensor in place."""
    file = src / raw_tensors(src)[name][3]
    data = bytearray(file.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    info = json.loads(data[8:8 + length])[name]
    assert info["dtype"] == "F32"
    start = 8 + length + info["data_offsets"][0]
    data[start:start + 4 * len(values)] = np.array(values, np.float32).tobytes()
    file.write_bytes(bytes(data))


def test_out_of_range_values_are_refused_then_clamped(home, tmp_path):
    src = build_tiny_model("llama", tmp_path / "src", dtype="float32")
    name = "model.layers.1.mlp.down_proj.weight"
    _poke_float32(src, name, [1e6, -1e6, 7e4, 1e-9, 65519.0])  # 3 too big, 1 too small
    source_hashes = hashes(src)
    dst = tmp_path / "clone"

    refused = run_omlx(home, "clone-fp16", str(src), str(dst))
    assert refused.returncode == 1
    assert f"{name} (3)" in refused.stderr and "--clamp" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not dst.exists() and leftovers(dst) == []

    clamped = run_omlx(home, "clone-fp16", str(src), str(dst), "--clamp", "--json", "--no-verify")
    assert clamped.returncode == 0, clamped.stderr
    report = json.loads(clamped.stdout)
    assert report["out_of_range"] == {name: 3} and report["clamped"] == 3
    assert report["underflowed"].get(name) == 1 and report["verification"] is None
    values = np.frombuffer(raw_tensors(dst)[name][2], np.float16)[:5]
    assert values.tolist() == [65504.0, -65504.0, 65504.0, 0.0, 65504.0]
    assert np.isfinite(np.frombuffer(raw_tensors(dst)[name][2], np.float16)).all()
    assert hashes(src) == source_hashes


def test_a_clone_with_non_finite_logits_fails_verification(tmp_path):
    src = build_tiny_model("llama", tmp_path / "src", dtype="float32")
    _poke_float32(src, "model.norm.weight", [float("inf")])  # not out of range: already inf
    dst = tmp_path / "clone"
    with pytest.raises(OmlxError, match="failed verification: the clone's logits are not finite"):
        clone_fp16(src, dst, verify_tokens=2)
    assert not dst.exists() and leftovers(dst) == []


@pytest.mark.parametrize("case", ["exists", "same", "inside", "contains"])
def test_bad_destinations_exit_2_and_touch_nothing(tiny, home, tmp_path, case):
    src = tiny("llama")
    source_hashes = hashes(src)
    dst = {"exists": tmp_path / "taken", "same": src, "inside": src / "clone",
           "contains": src.parent}[case]
    if case == "exists":
        dst.mkdir()
        (dst / "keep.txt").write_text("mine")
    result = run_omlx(home, "clone-fp16", str(src), str(dst), "--no-verify")
    assert result.returncode == 2, result.stderr
    assert {"exists": "--force", "same": "DST is SRC", "inside": "inside SRC",
            "contains": "inside DST"}[case] in result.stderr
    assert "Traceback" not in result.stderr
    assert hashes(src) == source_hashes
    if case == "exists":
        assert (dst / "keep.txt").read_text() == "mine"
    assert not (src / "clone").exists()


def test_force_replaces_only_after_success(tiny, tmp_path):
    src = tiny("llama")
    dst = tmp_path / "clone"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(InputError, match="--force"):
        clone_fp16(src, dst, verify=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (broken / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(InputError, match="truncated"):
        clone_fp16(broken, dst, force=True, verify=False)
    assert (dst / "old.txt").read_text() == "old"  # a failed clone leaves DST alone

    clone_fp16(src, dst, force=True, verify=False)
    assert not (dst / "old.txt").exists() and is_fp16_clone(dst)
    assert leftovers(dst) == []


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """About 768 MB of bf16 in three shards: a clone of it takes a moment to write."""
    from omlx_core.models.testing import tiny_config

    path = tmp_path_factory.mktemp("big") / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_config("llama")))
    for i in range(3):
        tensor = mx.full((128 << 20,), 0.5, dtype=mx.bfloat16)
        mx.save_safetensors(str(path / f"model-{i + 1:05d}-of-00003.safetensors"),
                            {f"big.{i}.weight": tensor}, metadata={"format": "mlx"})
        del tensor
    return path


def _start_and_signal(src: Path, dst: Path, home: Path, signum: int) -> subprocess.Popen:
    """Start a real clone, wait until it is writing shard data, then send `signum`."""
    proc = subprocess.Popen([sys.executable, "-m", "omlx_cli", "-q", "clone-fp16", str(src), str(dst),
                             "--no-verify"], env=omlx_env(home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tmp = dst.parent / f".{dst.name}.omlx-tmp-{proc.pid}"

    def writing() -> bool:
        try:
            return any(f.stat().st_size > 1 << 20 for f in tmp.glob("*.safetensors"))
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 60
    while not writing():
        assert proc.poll() is None, f"the clone ended before it was signalled: {proc.communicate()}"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signum)
    proc.wait(timeout=60)
    return proc


def test_sigterm_mid_clone_leaves_nothing(big_checkpoint, home, tmp_path):
    dst = tmp_path / "clone"
    proc = _start_and_signal(big_checkpoint, dst, home, signal.SIGTERM)
    assert proc.returncode == 143, proc.stderr.read()
    assert "terminated" in proc.stderr.read()
    assert not dst.exists() and leftovers(dst) == []


def test_sigkill_leftover_is_removed_by_the_next_clone(big_checkpoint, tiny, home, tmp_path):
    source_hashes = hashes(big_checkpoint)
    dst = tmp_path / "clone"
    proc = _start_and_signal(big_checkpoint, dst, home, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists()
    assert leftovers(dst) == [f".clone.omlx-tmp-{proc.pid}"]  # a dying process cannot clean up
    alive = dst.parent / f".clone.omlx-tmp-{os.getpid()}"  # a live clone's: left alone
    alive.mkdir()

    result = run_omlx(home, "clone-fp16", str(tiny("llama")), str(dst), "--no-verify")
    assert result.returncode == 0, result.stderr
    assert leftovers(dst) == [alive.name] and is_fp16_clone(dst)
    assert hashes(big_checkpoint) == source_hashes


def test_embedded_default_model_clone_matches_for_32_greedy_tokens(default_model, tmp_path):
    source_hashes = hashes(default_model.path)
    dst = tmp_path / "smollm2-fp16"
    report = clone_fp16(default_model, dst, verify_tokens=32)
    check = report.verification
    assert check["status"] == "passed", check
    assert check["tokens_matched"] == 32 and check["tokens_match"]
    assert check["compute_dtype"] == "float32"
    assert report.tensors_copied > 0  # its Q4_1 weights stay packed
    assert is_fp16_clone(dst) and not is_fp16_clone(default_model)
    assert hashes(default_model.path) == source_hashes


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a CPU backend limitation")
def test_a_forward_pass_the_backend_cannot_run_is_reported(tiny, tmp_path):
    # deepseek_v41's routed experts use GatherMM, which MLX's CPU backend runs only in
    # float32: the fp16 clone loads but cannot run in its own dtype here.
    src = tiny("deepseek_v41", dtype="float32")
    dst = tmp_path / "clone"
    report = clone_fp16(src, dst, verify_tokens=2)
    assert report.verification["status"] in ("passed", "diverged")
    check = compare_greedy(src, dst, steps=2, compute_dtype=None)
    assert check.status == "unavailable"
    assert "clone (float16)" in check.reason and "cpu" in check.reason
    assert "float32" in check.reason
