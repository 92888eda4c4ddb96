"""Prometheus metrics for /metrics, labelled by model, in a registry of the server's own.

A registry per server (not the process-global default) so two servers in one process,
as in the tests, never share counters. Prompt-cache figures are read from each loaded
model's cache when scraped (`PromptCacheCollector`), so they are never out of date.
"""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, \
    generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_STEP_BUCKETS = (0.002, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        labels = ["model"]
        self.running = Gauge("omlx_requests_running", "Requests generating now.", labels,
                             registry=self.registry)
        self.waiting = Gauge("omlx_requests_waiting", "Requests queued for a slot.", labels,
                             registry=self.registry)
        self.prompt_tokens = Counter("omlx_prompt_tokens", "Prompt tokens processed (cache hits included).",
                                     labels, registry=self.registry)
        self.cached_tokens = Counter("omlx_prompt_cached_tokens", "Prompt tokens served from the prefix cache.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("omlx_generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry)
        self.ttft = Histogram("omlx_time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("omlx_time_per_output_token_seconds",
                              "Mean time per token after the first, per request.", labels,
                              buckets=_TOKEN_BUCKETS, registry=self.registry)
        # Where the engine's time goes: a step that also prefilled admissions is a "prefill"
        # step and holds every running stream for its length (the inter-token tail).
        self.step = Histogram("omlx_engine_step_seconds", "Wall time of one engine step of a model's batch, "
                              "by phase (decode only, or decode with admissions' prefill).",
                              ["model", "phase"], buckets=_STEP_BUCKETS, registry=self.registry)
        self.kv_bytes = Gauge("omlx_kv_cache_bytes", "Live KV cache bytes of running requests.", labels,
                              registry=self.registry)
        self.memory_rejections = Counter("omlx_memory_guard_rejections",
                                         "Requests refused with 507 by the memory guard.", labels,
                                         registry=self.registry)
        self.queue_rejections = Counter("omlx_queue_rejections",
                                        "Requests refused with 503 because the queue was full.", labels,
                                        registry=self.registry)

    def watch_prompt_caches(self, loaded_models) -> None:
        """Export the prompt caches of `loaded_models()` (id -> LoadedModel) on every scrape."""
        self.registry.register(PromptCacheCollector(loaded_models))

    def finished(self, model: str, arrived: float, first_token_at: float | None,
                 finished_at: float, completion_tokens: int) -> None:
        """Record one finished request's latencies."""
        if first_token_at is None:
            return
        self.ttft.labels(model).observe(first_token_at - arrived)
        if completion_tokens > 1:
            self.tpot.labels(model).observe((finished_at - first_token_at) / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PromptCacheCollector:
    """Per-model prompt-cache figures: bytes and hit rate per tier, writer queue, bad files."""

    def __init__(self, loaded_models):
        self.loaded_models = loaded_models

    def collect(self):
        tiers = ["model", "tier"]
        size = GaugeMetricFamily("omlx_prompt_cache_bytes", "Bytes the prompt cache holds, per tier.",
                                 labels=tiers)
        rate = GaugeMetricFamily("omlx_prompt_cache_hit_rate",
                                 "Share of prompt tokens served from each tier.", labels=tiers)
        hits = CounterMetricFamily("omlx_prompt_cache_hit_tokens", "Prompt tokens served per tier.",
                                   labels=tiers)
        looked = CounterMetricFamily("omlx_prompt_cache_lookup_tokens",
                                     "Prompt tokens looked up in the prompt cache.", labels=["model"])
        depth = GaugeMetricFamily("omlx_prompt_cache_writer_queue_depth",
                                  "Cache entries waiting to be written to SSD.", labels=["model"])
        pending = GaugeMetricFamily("omlx_prompt_cache_writer_pending_bytes",
                                    "Bytes waiting to be written to SSD.", labels=["model"])
        dropped = CounterMetricFamily("omlx_prompt_cache_dropped_writes",
                                      "SSD writes dropped because the writer queue was full.",
                                      labels=["model"])
        corrupt = CounterMetricFamily("omlx_prompt_cache_corrupt_files",
                                      "Cache files that failed verification and were deleted.",
                                      labels=["model"])
        for model_id, model in list(self.loaded_models().items()):
            stats = model.prompt_cache.stats()
            disk, writer = stats["disk"] or {}, stats["writer"] or {}
            size.add_metric([model_id, "memory"], stats["memory"]["bytes"])
            size.add_metric([model_id, "disk"], disk.get("bytes", 0))
            for tier in ("memory", "disk"):
                rate.add_metric([model_id, tier], stats["hit_rate"][tier])
                hits.add_metric([model_id, tier], stats["hit_tokens"][tier])
            looked.add_metric([model_id], stats["prompt_tokens"])
            depth.add_metric([model_id], writer.get("pending_entries", 0))
            pending.add_metric([model_id], writer.get("pending_bytes", 0))
            dropped.add_metric([model_id], writer.get("dropped", 0))
            corrupt.add_metric([model_id], disk.get("corrupt_files", 0))
        yield from (size, rate, hits, looked, depth, pending, dropped, corrupt)
