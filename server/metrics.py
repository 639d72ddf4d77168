"""Prometheus metrics, made at scrape time from each engine replica's ``EngineSnapshot``.

Serving metrics carry vLLM v1's names with the ``vattn:`` prefix, so vLLM's dashboards port over; KV memory
metrics, which vLLM cannot show, are per worker (``pp_rank``, ``tp_rank``). Every series is labelled
``model_name`` and ``replica``. ``docs/metrics.md`` describes each.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from cluster.telemetry import EngineSnapshot, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE = ["model_name", "replica"]
WORKER = [*ENGINE, "pp_rank", "tp_rank"]

SERVING_GAUGES = {
    "num_requests_running": ("Requests running (holding KV memory).", lambda s: s.num_running),
    "num_requests_waiting": ("Requests waiting to be scheduled (preempted by recompute included).", lambda s: s.num_waiting),
    "num_requests_swapped": ("Requests preempted by swap, their KV in host memory.", lambda s: s.num_swapped),
    "kv_cache_usage_perc": ("Fraction of KV pages held by running requests (the tightest worker), 0-1.", lambda s: s.kv_usage),
}
SERVING_COUNTERS = {
    "prompt_tokens": ("Prompt tokens of requests that got their first token.", lambda s: s.prompt_tokens),
    "generation_tokens": ("Tokens generated.", lambda s: s.generation_tokens),
    "num_preemptions": ("Sequences preempted (recompute or swap).", lambda s: s.num_preemptions),
    "num_engine_rebuilds": ("Times the worker group failed and was rebuilt.", lambda s: s.num_rebuilds),
    "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache (of sequences computing from their start).",
                             lambda s: s.prefix_cache_queries),
    "prefix_cache_hits": ("Prompt tokens found in the prefix cache (not computed).", lambda s: s.prefix_cache_hits),
    "engine_step_seconds": ("Seconds spent in engine steps (scheduling and the workers' round trip).", lambda s: s.step_seconds),
}
HISTOGRAMS = {
    "time_to_first_token_seconds": "Seconds from arrival to the first token.",
    "inter_token_latency_seconds": "Seconds between two tokens of one sequence.",
    "e2e_request_latency_seconds": "Seconds from arrival to the end of a request.",
    "request_queue_time_seconds": "Seconds from arrival to the first schedule.",
    "iteration_tokens_total": "Tokens per engine step.",
    "request_ingress_seconds": "Seconds from the HTTP front taking a request in to the engine queueing it.",
    "first_token_pickup_seconds": "Seconds from the engine buffering a request's first token to a client's poll taking it.",
    "stream_outputs_per_poll": "Step outputs of a streamed request a client's poll took at once (1: it kept up with the steps).",
}
WORKER_GAUGES = {
    "kv_reserved_bytes": ("Virtual address space reserved for the KV cache (paged: the block pool).", lambda w: w.reserved_bytes),
    "kv_pool_bytes": ("Physical KV memory that exists (the page pool).", lambda w: w.pool_bytes),
    "kv_mapped_bytes": ("Physical KV memory mapped into slots.", lambda w: w.mapped_bytes),
    "kv_used_bytes": ("KV memory holding valid tokens.", lambda w: w.used_bytes),
    "kv_free_pages": ("Pages the pool can hand out now.", lambda w: w.free_pages),
    "kv_total_pages": ("Pages of the pool.", lambda w: w.total_pages),
    "kv_fragmentation": ("1 - used/mapped: mapped memory that holds no valid token.", lambda w: w.fragmentation),
    "kv_slots_in_use": ("Slots (one per running sequence) in use.", lambda w: w.slots_in_use),
    "kv_swap_bytes": ("Host memory holding swapped-out KV.", lambda w: w.swap_bytes),
    "kv_prefix_cache_pages": ("Pages (per buffer) holding cached prefix blocks, some also mapped in running slots.",
                              lambda w: w.prefix_cache_pages),
    "kv_prefix_cache_bytes": ("Physical KV memory holding cached prefix blocks (all buffers).", lambda w: w.prefix_cache_bytes),
}
WORKER_COUNTERS = {
    "kv_pages_mapped": ("Page mappings made (map calls of page groups).", lambda w: w.maps),
    "kv_pages_unmapped": ("Page mappings undone.", lambda w: w.unmaps),
    "kv_mapping_stall_seconds": ("Seconds steps waited for pages to be mapped.", lambda w: w.stall_seconds),
    "worker_busy_seconds": ("Seconds the worker spent in steps: launching them and waiting for them.", lambda w: w.busy_seconds),
    "worker_device_seconds": ("Seconds the device ran the worker's steps, first kernel to last (CUDA; 0 elsewhere).",
                              lambda w: w.device_seconds),
}


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, n in zip((*map(str, h.bounds), "+Inf"), h.counts):
        running += n
        out.append((bound, running))
    return out


class SnapshotCollector:
    """One scrape's worth of snapshots: ``(model_name, replica) -> EngineSnapshot``."""

    def __init__(self, snapshots: dict[tuple[str, str], EngineSnapshot]):
        self.snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}

        def family(kind, name: str, doc: str, labels: list[str]) -> Metric:
            if name not in families:
                families[name] = kind(f"vattn:{name}", doc, labels=labels)
            return families[name]

        for (model, replica), s in self.snapshots.items():
            engine = [model, replica]
            for name, (doc, value) in SERVING_GAUGES.items():
                family(GaugeMetricFamily, name, doc, ENGINE).add_metric(engine, value(s))
            for name, (doc, value) in SERVING_COUNTERS.items():
                family(CounterMetricFamily, name, doc, ENGINE).add_metric(engine, value(s))
            success = family(CounterMetricFamily, "request_success", "Requests ended, by finish reason.",
                             [*ENGINE, "finished_reason"])
            for reason in sorted({"stop", "length", "abort", "error", *s.finished}):
                success.add_metric([*engine, reason], s.finished.get(reason, 0))
            for name, doc in HISTOGRAMS.items():
                h = s.histograms[name]
                family(HistogramMetricFamily, name, doc, ENGINE).add_metric(engine, _buckets(h), h.total)
            for w in s.workers:
                labels = [*engine, str(w.pp_rank), str(w.tp_rank)]
                for name, (doc, value) in WORKER_GAUGES.items():
                    family(GaugeMetricFamily, name, doc, WORKER).add_metric(labels, value(w))
                for name, (doc, value) in WORKER_COUNTERS.items():
                    family(CounterMetricFamily, name, doc, WORKER).add_metric(labels, value(w))
                family(HistogramMetricFamily, "kv_map_latency_seconds", "Seconds to map one page group.", WORKER) \
                    .add_metric(labels, _buckets(w.map_latency), w.map_latency.total)
        yield from families.values()


def render(snapshots: dict[tuple[str, str], EngineSnapshot]) -> bytes:
    """The Prometheus text exposition of ``snapshots``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshots))
    return generate_latest(registry)
