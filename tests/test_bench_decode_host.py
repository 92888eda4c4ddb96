"""decode_host.py: its profile reader on py-spy's raw format, and a real run of the stock
variant on a tiny model (the kernels variant needs CUDA: reported as skipped here)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import decode_host  # noqa: E402

RAW = """<module> (decode_host.py:238);main (decode_host.py:198);build_model (decode_host.py:43) 50
<module> (decode_host.py:238);main (decode_host.py:198);loop (decode_host.py:132);mlx::core::async_eval (libmlx.so);mlx::core::eval_impl (libmlx.so) 30
<module> (decode_host.py:238);main (decode_host.py:198);loop (decode_host.py:131);step (decode_host.py:84);Model.__call__ (mlx_lm/models/qwen3.py:189) 10
not a stack line
"""


def test_summarize_counts_only_the_loop_and_ranks_frames():
    summary = decode_host.summarize(RAW)
    assert (summary["samples"], summary["all_samples"]) == (40, 90)
    assert summary["leaf"][0] == {"frame": "mlx::core::eval_impl (libmlx.so)", "pct": 75.0}
    inclusive = {entry["frame"]: entry["pct"] for entry in summary["inclusive"]}
    assert inclusive["main (decode_host.py:198)"] == 100.0
    assert inclusive["mlx::core::async_eval (libmlx.so)"] == 75.0
    assert "build_model (decode_host.py:43)" not in inclusive


def test_summarize_of_no_loop_samples_is_empty():
    assert decode_host.summarize("main (x.py:1) 5\n") == {"samples": 0, "all_samples": 5, "leaf": [], "inclusive": []}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "decode_host.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_stock_step_is_timed_and_the_kernels_say_why_not():
    done = run("--batch", "2", "--layers", "2", "--hidden", "128", "--ctx", "8", "--steps", "3", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    stock, *others = result["rows"]
    assert stock["variant"] == "stock"
    assert [row["variant"] for row in others] == ["kernels", "prologue", "residual", "residual_copying", "fused"]
    assert all(stock[key] > 0 for key in ("build_ms", "encode_ms", "wait_ms", "pipelined_ms"))
    if result["backend"] != "cuda":
        for row in others:
            assert row == {"variant": row["variant"], "skipped": row["skipped"]} and "CUDA" in row["skipped"]


def test_python_profile_ranks_the_models_own_functions():
    done = run("--variants", "stock", "--batch", "2", "--layers", "2", "--hidden", "128", "--ctx", "8",
               "--steps", "3", "--python-profile", "--json")
    assert done.returncode == 0, done.stderr
    profile = json.loads(done.stdout)["python_profile"]
    assert profile["variant"] == "stock" and profile["steps"] == 3
    functions = profile["functions"]
    assert [row["self_us"] for row in functions] == sorted((row["self_us"] for row in functions), reverse=True)
    step = next(row for row in functions if row["function"].startswith("greedy_step (bench/decode.py:"))
    assert step["calls"] == 1 and step["total_us"] >= max(row["self_us"] for row in functions)
    assert any(row["function"].startswith("__call__ (models/qwen3.py:") for row in functions)


def test_function_label_names_a_builtin_and_a_file():
    assert decode_host.function_label(("~", 0, "<built-in method builtins.len>")) == "<built-in method builtins.len>"
    assert decode_host.function_label(("/a/b/models/qwen3.py", 70, "__call__")) == "__call__ (models/qwen3.py:70)"


def test_unknown_variant_is_refused_by_name():
    done = run("--variants", "stock,fast")
    assert done.returncode == 2
    assert "--variants: unknown fast" in done.stderr


def test_primitives_count_the_steps_graph_by_name():
    done = run("--variants", "stock", "--batch", "2", "--layers", "3", "--hidden", "128", "--ctx", "8",
               "--steps", "2", "--primitives", "--json")
    assert done.returncode == 0, done.stderr
    counted = json.loads(done.stdout)["rows"][0]["primitives"]
    by_name = counted["by_name"]
    assert counted["total"] == sum(by_name.values())
    assert list(by_name.values()) == sorted(by_name.values(), reverse=True)
    # seven quantized projections a layer (q, k, v, o, gate, up, down) and the lm head
    assert by_name["QuantizedMatmul"] == 7 * 3 + 1
