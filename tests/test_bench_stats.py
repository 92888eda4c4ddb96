"""`omlx bench` pure parts: lengths, statistics, bootstrap ratios, SSE, variants, schema."""

import asyncio
import json
import math

import numpy as np
import pytest

from omlx_core.bench import schema
from omlx_core.bench.compare import gate
from omlx_core.bench.sse import sse_events
from omlx_core.bench.stats import bootstrap_ratio, percentiles, summarize
from omlx_core.bench.variants import VariantSpec, parse_variant, variant_settings
from omlx_core.bench.workload import Workload
from omlx_core.errors import InputError
from omlx_core.settings import set_setting
from omlx_core.units import parse_counts


def test_ctx_lengths_parse_as_people_type_them():
    assert parse_counts("16k", "--ctx") == [16384]
    assert parse_counts("4096", "--ctx") == [4096]
    assert parse_counts("1m", "--ctx") == [1048576]
    assert parse_counts("4k,16k", "--ctx") == [4096, 16384]
    with pytest.raises(InputError, match="--ctx"):
        parse_counts("16q", "--ctx")
    with pytest.raises(InputError, match="--ctx"):
        Workload(ctx=(0,))
    with pytest.raises(InputError, match="--repeats"):
        Workload(ctx=(16,), repeats=0)


def test_summary_of_known_samples():
    s = summarize([1, 2, 3, 4, 10])
    assert (s.median, s.mean, s.min, s.max) == (3, 4, 1, 10)
    assert s.stddev == pytest.approx(math.sqrt(sum((x - 4) ** 2 for x in [1, 2, 3, 4, 10]) / 4))
    assert summarize([2, 4]).median == 3
    assert summarize([7]).stddev == 0.0
    assert summarize([7]).as_dict()["samples"] == [7.0]


def test_percentiles_interpolate_and_handle_no_data():
    found = percentiles(range(101))
    assert (found["p50"], found["p90"], found["p99"], found["mean"]) == (50, 90, 99, 50)
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_bootstrap_interval_contains_the_true_ratio_and_is_reproducible():
    rng = np.random.default_rng(1234)
    hits = 0
    for trial in range(20):
        a = rng.normal(100.0, 5.0, 9)
        b = rng.normal(80.0, 4.0, 9)  # true ratio of medians: 0.8
        found = bootstrap_ratio(a, b)
        assert found.low <= found.ratio <= found.high
        hits += found.low <= 0.8 <= found.high
    assert hits >= 17  # a 95% interval misses about one time in twenty
    a, b = [10.0, 11.0, 9.0], [5.0, 5.5, 4.5]
    assert bootstrap_ratio(a, b) == bootstrap_ratio(a, b)  # seeded: same data, same interval
    assert bootstrap_ratio(a, b).ratio == pytest.approx(0.5)


def test_gate_fails_on_the_worst_context_length():
    def comparison(ctx, ratio):
        return {"ctx": ctx, "metrics": {"prefill_tps": {"ratio": ratio, "low": ratio, "high": ratio}}}

    passed = gate([comparison(512, 1.02), comparison(4096, 0.95)], 0.9)
    assert passed["passed"] and passed["worst_ctx"] == 4096
    failed = gate([comparison(512, 1.02), comparison(4096, 0.85)], 0.9)
    assert not failed["passed"] and failed["worst_ratio"] == 0.85
    assert not gate([], 0.9)["passed"]  # nothing measured is not a pass


async def _lines(*lines):
    for line in lines:
        yield line


def _events(*lines):
    async def collect():
        return [event async for event in sse_events(_lines(*lines))]

    return asyncio.run(collect())


def test_sse_events_skip_comments_and_stop_at_done():
    events = _events(": keepalive 10/100", "", 'data: {"choices": [{"text": "a"}]}', "",
                     "event: x", 'data: {"usage":', 'data:  {"n": 1}}', "", "data: [DONE]", "",
                     'data: {"after": "done"}', "")
    assert events == [{"choices": [{"text": "a"}]}, {"usage": {"n": 1}}]
    assert _events("data: not json", "") == [{"raw": "not json"}]
    assert _events('data: {"last": 1}') == [{"last": 1}]  # connection closed without a blank line


def test_variant_syntax_profiles_and_sets():
    base = VariantSpec(None, {"prefill.chunk_size": "1024"})
    assert parse_variant("", base) == base
    spec = parse_variant("fast prefill.chunk_size=4k", base)
    assert spec.profile == "fast" and spec.sets == {"prefill.chunk_size": "4k"}
    assert spec.text == "fast prefill.chunk_size=4k"
    with pytest.raises(InputError, match="profiles"):
        parse_variant("fast slow")
    with pytest.raises(InputError, match="unknown setting"):
        parse_variant("prefill.chunk=512")
    with pytest.raises(InputError, match="prefill.chunk_size"):
        parse_variant("prefill.chunk_size=tiny")


def test_variant_settings_follow_precedence_with_a_named_profile(home):
    set_setting(home, "prefill.chunk_size", "512", model_key="m", profile="fast")
    set_setting(home, "prefill.chunk_size", "1024", model_key="m")  # the active profile
    active = variant_settings(home, "m", VariantSpec(), environ={})
    assert active.resolved["prefill.chunk_size"].value == 1024
    fast = variant_settings(home, "m", VariantSpec("fast"), environ={})
    assert fast.resolved["prefill.chunk_size"].value == 512
    assert fast.resolved["prefill.chunk_size"].source == "model"
    env = variant_settings(home, "m", VariantSpec("fast"), environ={"OMLX_PREFILL_CHUNK_SIZE": "64"})
    assert env.resolved["prefill.chunk_size"].source == "env"
    cli = variant_settings(home, "m", VariantSpec("fast", {"prefill.chunk_size": "32"}),
                           environ={"OMLX_PREFILL_CHUNK_SIZE": "64"})
    assert cli.resolved["prefill.chunk_size"].value == 32
    with pytest.raises(InputError, match="no profile 'slow'"):
        variant_settings(home, "m", VariantSpec("slow"), environ={})


def test_schema_rejects_documents_that_lack_required_keys():
    with pytest.raises(InputError, match="missing"):
        schema.loads(json.dumps({"schema": schema.SCHEMA, "mode": "offline"}))
    with pytest.raises(InputError, match="omlx.bench/0"):
        schema.validate({key: [] for key in schema.COMMON_KEYS} | {"schema": "omlx.bench/0"})
