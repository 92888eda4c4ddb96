"""`omlx bench` offline on tiny models: exact token counts, the document, gates, baselines."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest

from conftest import run_omlx
from omlx_core.bench import render, schema
from omlx_core.bench.offline import run_offline
from omlx_core.bench.runs import run_generation, run_mlx_lm
from omlx_core.bench.variants import OMLX, Variant, VariantSpec, variant_settings
from omlx_core.bench.workload import Workload, ordinary_token_ids, synthetic_prompts
from omlx_core.models.load import load_model
from omlx_core.models.resolve import resolve
from omlx_core.models.testing import EOS_TOKEN_ID, SPECIAL_TOKENS, VOCAB_SIZE, build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("bench") / "llama")


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(resolve(str(tiny), tiny.parent))


class CountingModel:
    """The real model, recording the shape of every input it is given."""

    def __init__(self, model):
        self.model = model
        self.calls = []

    def __call__(self, inputs, cache=None):
        self.calls.append(tuple(inputs.shape))
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_prompts_are_ordinary_tokens_and_reproducible(loaded):
    _, tokenizer = loaded
    vocabulary = ordinary_token_ids(tokenizer, VOCAB_SIZE)
    assert not set(vocabulary.tolist()) & set(range(len(SPECIAL_TOKENS)))
    first = synthetic_prompts(vocabulary, 300, 2, seed=7)
    assert first.shape == (2, 300)
    assert np.array_equal(first, synthetic_prompts(vocabulary, 300, 2, seed=7))
    assert not np.array_equal(first, synthetic_prompts(vocabulary, 300, 2, seed=8))
    assert not np.array_equal(first[0], first[1])


@pytest.mark.parametrize("batch", [1, 3])
def test_exact_prompt_and_generation_counts_in_chunks(loaded, batch):
    model, tokenizer = loaded
    counting = CountingModel(model)
    prompts = synthetic_prompts(ordinary_token_ids(tokenizer, VOCAB_SIZE), 100, batch, seed=0)
    run = run_generation(counting, prompts, gen=9, chunk_size=32, suppress={EOS_TOKEN_ID})
    # prefill: 99 tokens in chunks of at most 32, then the last one with the first sample
    assert counting.calls[:4] == [(batch, 32), (batch, 32), (batch, 32), (batch, 3)]
    assert counting.calls[4] == (batch, 1)
    fed_prompt = sum(width for _, width in counting.calls[:5])
    decode_steps = counting.calls[5:]
    assert fed_prompt == 100 and run.prompt_tokens == 100
    assert decode_steps == [(batch, 1)] * 8  # the 9th token is read back, never fed
    assert run.generated_tokens == 9 and run.batch == batch
    assert run.cache_tokens == 100 + 9 - 1  # the KV cache's own count agrees
    assert run.prefill_tps == pytest.approx(batch * 100 / run.ttft_s)
    assert run.decode_tps == pytest.approx(batch * 8 / run.decode_s)
    assert 0 < run.ttft_s < run.e2e_s and run.peak_mlx_memory_bytes > 0 and run.peak_rss_bytes > 0


def test_eos_is_masked_so_generation_never_stops(loaded):
    model, tokenizer = loaded
    prompts = synthetic_prompts(ordinary_token_ids(tokenizer, VOCAB_SIZE), 16, 1, seed=0)

    class Recording(CountingModel):
        def __call__(self, inputs, cache=None):
            logits = self.model(inputs, cache=cache)
            # make EOS the model's favourite at every step: only the mask can stop it
            boost = mx.zeros((logits.shape[-1],)).at[EOS_TOKEN_ID].add(1e4)
            return logits + boost

    unmasked = run_generation(Recording(model), prompts, gen=6, chunk_size=2048, suppress=set())
    assert unmasked.token_ids == ((EOS_TOKEN_ID,) * 6,)  # the boost works ...
    run = run_generation(Recording(model), prompts, gen=6, chunk_size=2048, suppress={EOS_TOKEN_ID})
    assert run.generated_tokens == 6 and len(run.token_ids[0]) == 6
    assert EOS_TOKEN_ID not in run.token_ids[0]  # ... and the mask beats it
    stock = run_mlx_lm(model, tokenizer, prompts, gen=6)  # stock mlx-lm, EOS ids emptied
    assert (stock.prompt_tokens, stock.generated_tokens) == (16, 6)


def test_run_offline_document_round_trips_through_json(tiny):
    ref = resolve(str(tiny), tiny.parent)
    settings = variant_settings(tiny.parent, ref.key, VariantSpec(None, {"prefill.chunk_size": "64"}))
    variant = Variant(OMLX, OMLX, "prefill.chunk_size=64", settings)
    progress = []
    document = run_offline(ref, Workload((48, 96), gen=5, repeats=2, warmup=1), [variant], settings,
                           on_progress=lambda done, total, what: progress.append((done, total)))
    assert progress[-1] == (6, 6)  # 2 lengths x (1 warm-up + 2 repeats) x 1 variant
    assert document["schema"] == "omlx.bench/1" and document["mode"] == "offline"
    assert schema.loads(schema.dumps(document)) == document
    assert schema.loads(schema.dumps(document, line=True)) == document
    assert document["settings"]["prefill.chunk_size"] == {"value": 64, "source": "cli",
                                                          "where": "command line"}
    assert document["model"]["fingerprint"].startswith("mf-")
    assert document["hardware"]["fingerprint"].startswith("hw-")
    for result, ctx in zip(document["results"], (48, 96)):
        assert result["tokens"] == {"prompt": ctx, "generated": 5, "cache": ctx + 4}
        prefill = result["metrics"]["prefill_tps"]
        assert len(prefill["samples"]) == 2  # the warm-up is not among them
        assert prefill["min"] <= prefill["median"] <= prefill["max"]
    assert document["comparisons"] == [] and document["gate"] is None
    text = render.markdown(document)
    assert "prefill tok/s" in text and "| 96 |" in text
    rows = render.csv_text(document).splitlines()
    assert rows[0].startswith("kind,variant,ctx") and len(rows) == 1 + 2 * 6


def test_cli_json_is_clean_and_output_appends_history(home, tiny, tmp_path):
    history = tmp_path / "bench.jsonl"
    args = ("bench", "--model", str(tiny), "--ctx", "32", "--gen", "4", "--repeats", "2",
            "--set", "prefill.chunk_size=16", "--json", "--output", str(history))
    first = run_omlx(home, *args, check=True)
    document = schema.loads(first.stdout)  # stdout is exactly one JSON document
    json.loads(first.stdout)
    assert document["workload"] == {"ctx": [32], "gen": 4, "batch": 1, "repeats": 2, "warmup": 1,
                                    "seed": 0}
    assert document["variants"][0]["settings"]["prefill.chunk_size"]["value"] == 16
    run_omlx(home, *args, check=True)
    lines = history.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["schema"] == "omlx.bench/1" for line in lines)
    assert schema.load(history)["created"] == json.loads(lines[-1])["created"]

    table = run_omlx(home, "bench", "--model", str(tiny), "--ctx", "32", "--gen", "2",
                     "--repeats", "1", "--warmup", "0", "--format", "csv", check=True)
    assert table.stdout.startswith("kind,variant,ctx,batch,gen,metric")


def test_bad_bench_usage_exits_2(home, tiny):
    for args in (("--ctx", "lots"), ("--format", "xml"), ("--fail-below", "0.9"),
                 ("--set", "prefill.chunk_size=3"), ("--baseline", "vllm"),
                 ("--compare", "a b", "c"), ("--url", "http://127.0.0.1:9", "--batch", "2")):
        result = run_omlx(home, "bench", "--model", str(tiny), *args)
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr


def _prefill_ratio(result) -> float:
    return json.loads(result.stdout)["gate"]["worst_ratio"]


def test_compare_gate_exits_1_when_b_is_slower_and_0_the_other_way(home, tiny):
    """One 1536-token chunk is reliably slower here than 128-token chunks: the single chunk
    computes the whole square attention matrix, small chunks only the causal part they need
    (measured at B/A 0.63-0.69 for this model on the 2-core CI machine)."""
    common = ("bench", "--model", str(tiny), "--ctx", "1536", "--gen", "2", "--repeats", "3",
              "--fail-below", "0.9", "--json")
    slower = run_omlx(home, *common, "--compare", "prefill.chunk_size=128", "prefill.chunk_size=2048")
    assert slower.returncode == 1, slower.stderr
    assert "below --fail-below 0.9" in slower.stderr
    document = schema.loads(slower.stdout)
    assert [v["spec"] for v in document["variants"]] == ["prefill.chunk_size=128",
                                                         "prefill.chunk_size=2048"]
    ratio = document["comparisons"][0]["metrics"]["prefill_tps"]
    assert ratio["ratio"] < 0.9 and ratio["low"] <= ratio["ratio"] <= ratio["high"]
    assert document["gate"]["passed"] is False

    faster = run_omlx(home, *common, "--compare", "prefill.chunk_size=2048", "prefill.chunk_size=128")
    assert faster.returncode == 0, faster.stderr
    assert _prefill_ratio(faster) > 1.0


def test_baseline_and_against_a_stored_run(home, tiny, tmp_path):
    common = ("bench", "--model", str(tiny), "--ctx", "64", "--gen", "4", "--repeats", "2")
    with_stock = run_omlx(home, *common, "--baseline", "mlx-lm", "--json", check=True)
    document = schema.loads(with_stock.stdout)
    assert [v["runner"] for v in document["variants"]] == ["mlx-lm", "omlx"]
    stock = next(r for r in document["results"] if r["variant"] == "mlx-lm")
    assert stock["tokens"]["prompt"] == 64 and stock["tokens"]["generated"] == 4
    (comparison,) = document["comparisons"]
    assert (comparison["a"], comparison["b"]) == ("mlx-lm", "omlx")
    assert math.isfinite(comparison["metrics"]["decode_tps"]["ratio"])

    stored = tmp_path / "baseline.json"
    stored.write_text(run_omlx(home, *common, "--json", check=True).stdout)
    gated = run_omlx(home, *common, "--against", str(stored), "--fail-below", "0.01", "--json")
    assert gated.returncode == 0, gated.stderr
    again = schema.loads(gated.stdout)
    assert again["comparisons"][0]["a"] == f"baseline:{stored}" and again["gate"]["passed"]
    other = run_omlx(home, "bench", "--model", str(tiny), "--ctx", "32", "--gen", "4",
                     "--against", str(stored))
    assert other.returncode == 2 and "same --ctx" in other.stderr
