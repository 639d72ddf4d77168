"""The Grafana dashboards, as code: ``python dashboards/build.py`` writes ``kv-memory.json`` and ``serving.json``
next to this file; ``--check`` exits 1 if they differ from a fresh build. ``README.md`` says what every panel means.

Every query filters by the dashboard's template variables, so one dashboard serves every namespace and model a
Prometheus holds; ``docs/metrics.md`` documents each metric.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, prometheus, stat, timeseries
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import (DashboardCursorSync, DataSourceRef, VariableOption,
                                                     VariableRefresh, VariableSort)

HERE = Path(__file__).parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
# Outside Kubernetes nothing adds a namespace label: "All" must be a regex that an absent label (empty) matches.
ALL = ".*"

# Label filters. Preemptions and the step time are per engine replica, so they take the replica filter but not
# the worker ranks (a rank filter would hide them whenever a rank is picked).
SERVING = 'namespace=~"$namespace", model_name=~"$model"'
REPLICA = f'{SERVING}, replica=~"$replica"'
WORKER = f'{REPLICA}, pp_rank=~"$pp_rank", tp_rank=~"$tp_rank"'
BY_MODEL = "namespace, model_name"
BY_REPLICA = "namespace, model_name, replica"
BY_WORKER = "namespace, model_name, replica, pp_rank, tp_rank"
WORKER_LEGEND = "{{replica}} pp{{pp_rank}} tp{{tp_rank}}"


def query(expr: str, legend: str) -> prometheus.Dataquery:
    """A range query on the dashboard's Prometheus."""
    return prometheus.Dataquery().expr(expr).legend_format(legend).range().datasource(DATASOURCE)


def rate(metric: str, labels: str, by: str) -> str:
    """Per-second increase of a counter, summed ``by`` the grouping labels."""
    return f"sum by ({by}) (rate({metric}{{{labels}}}[{RATE}]))"


def quantiles(metric: str, labels: str, by: str, legend: str) -> list[prometheus.Dataquery]:
    """p50 and p99 of a histogram over the rate window, one series per group of ``by``."""
    return [query(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{labels}}}[{RATE}])))",
                  f"{legend} p{round(q * 100)}") for q in (0.5, 0.99)]


def panel(title: str, description: str, unit: str, targets: list[prometheus.Dataquery], width: int = 12,
          height: int = 8, kind: str = "timeseries", max_value: float | None = None):
    """A panel on the dashboard's Prometheus: a time series (legend as a table with the last and max values) or
    a stat showing the last value."""
    if kind == "stat":
        p = stat.Panel().reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]))
    else:
        p = timeseries.Panel().fill_opacity(10).legend(
            common.VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.TABLE)
            .placement(LegendPlacement.BOTTOM).calcs(["lastNotNull", "max"]))
    p = p.title(title).description(description).unit(unit).datasource(DATASOURCE).span(width).height(height) \
        .targets([t.ref_id(chr(ord("A") + i)) for i, t in enumerate(targets)]).min(0)
    if max_value is not None:
        p = p.max(max_value)
    return p


def variables(worker: bool) -> list:
    """``datasource``, ``namespace``, ``model`` and, with ``worker``, ``replica``, ``pp_rank``, ``tp_rank``: each a
    multi-value pick, All (``.*``) at first, each narrowed by the ones before it."""
    out = [DatasourceVariable("datasource").id("datasource").label("Data source").type("prometheus")]
    chain = []
    for name, label, metric in [("namespace", "namespace", "vattn:num_requests_running"),
                                ("model", "model_name", "vattn:num_requests_running"),
                                *([("replica", "replica", "vattn:kv_mapped_bytes"),
                                   ("pp_rank", "pp_rank", "vattn:kv_mapped_bytes"),
                                   ("tp_rank", "tp_rank", "vattn:kv_mapped_bytes")] if worker else [])]:
        selector = f"{metric}{{{', '.join(chain)}}}" if chain else metric
        out.append(QueryVariable(name).id(name).label(name).datasource(DATASOURCE)
                   .query(f"label_values({selector}, {label})").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                   .sort(VariableSort.ALPHABETICAL_ASC).multi(True).include_all(True).all_value(ALL)
                   .current(VariableOption(selected=True, text=["All"], value=["$__all"])))
        chain.append(f'{label}=~"${name}"')
    return out


def dashboard(uid: str, title: str, description: str, worker: bool, rows: list[tuple[str, list]]) -> Dashboard:
    """A dashboard of open rows (a row header, then its panels on the grid), panel ids numbered in order."""
    d = Dashboard(title).uid(uid).description(description).tags(["vattn"]).editable().time("now-1h", "now") \
        .refresh("30s").tooltip(DashboardCursorSync.CROSSHAIR).variables(variables(worker))
    next_id = 1
    for row_title, panels in rows:
        d = d.with_row(Row(row_title).id(next_id))
        next_id += 1
        for p in panels:
            d = d.with_panel(p.id(next_id))
            next_id += 1
    return d


def kv_memory() -> Dashboard:
    """Per worker: what the KV cache reserves, maps and uses, how fast it maps, and what it costs the steps."""
    w, by = WORKER, BY_WORKER
    return dashboard("vattn-kv-memory", "vattn: KV memory",
                     "vattn's virtual-memory KV cache, per worker (replica, pipeline rank, tensor rank): "
                     "the virtual reservation, the physical pages mapped into it, the tokens they hold.", True, [
        ("Memory", [
            panel("Reserved vs mapped vs used", "Per worker: virtual address space reserved for the KV cache; "
                  "physical memory mapped into its slots; memory holding valid tokens. Mapped far above used is "
                  "fragmentation; mapped near the pool is memory pressure.", "bytes", [
                query(f"vattn:kv_reserved_bytes{{{w}}}", f"{WORKER_LEGEND} reserved"),
                query(f"vattn:kv_mapped_bytes{{{w}}}", f"{WORKER_LEGEND} mapped"),
                query(f"vattn:kv_used_bytes{{{w}}}", f"{WORKER_LEGEND} used")]),
            panel("Fragmentation", "1 - used/mapped: the share of mapped memory that holds no token (the tail "
                  "of each sequence's last page, and free slots keeping their pages until reclaimed).",
                  "percentunit", [query(f"vattn:kv_fragmentation{{{w}}}", WORKER_LEGEND)], max_value=1),
            panel("Pool size", "Physical KV memory that exists: the page pool each worker maps from.", "bytes",
                  [query(f"vattn:kv_pool_bytes{{{w}}}", WORKER_LEGEND)], width=6, kind="stat"),
            panel("Free pages", "Pages the pool can hand out now, against the pool's total. Free near zero: new "
                  "sequences wait and running ones get preempted.", "none", [
                query(f"vattn:kv_free_pages{{{w}}}", f"{WORKER_LEGEND} free"),
                query(f"vattn:kv_total_pages{{{w}}}", f"{WORKER_LEGEND} total")], width=9),
            panel("Slots in use", "KV slots in use: one per running sequence, plus the CUDA graphs' scratch slot.",
                  "none", [query(f"vattn:kv_slots_in_use{{{w}}}", WORKER_LEGEND)], width=9),
        ]),
        ("Mapping", [
            panel("Pages mapped / unmapped per second", "Page-group mappings made (sequences growing) and undone "
                  "(reclaim, shrink) per second.", "ops", [
                query(rate("vattn:kv_pages_mapped_total", w, by), f"{WORKER_LEGEND} mapped"),
                query(rate("vattn:kv_pages_unmapped_total", w, by), f"{WORKER_LEGEND} unmapped")], width=8),
            panel("Map latency p50 / p99", "Seconds to map one page group, median and 99th percentile over the "
                  "rate window (empty while nothing was mapped).", "s",
                  quantiles("vattn:kv_map_latency_seconds", w, by, WORKER_LEGEND), width=8),
            panel("Mapping stall per step", "Share of engine step time spent waiting for pages to be mapped; "
                  "mapping ahead of the step hides the rest. Above 1% the mapping is on the critical path.",
                  "percentunit", [query(
                      f"{rate('vattn:kv_mapping_stall_seconds_total', w, by)} / on({BY_REPLICA}) group_left "
                      f"{rate('vattn:engine_step_seconds_total', REPLICA, BY_REPLICA)}", WORKER_LEGEND)], width=8),
        ]),
        ("Pressure", [
            panel("Preemptions per second", "Sequences preempted (by recompute or swap) per second, per engine "
                  "replica: the KV pool ran out of free pages.", "ops",
                  [query(rate("vattn:num_preemptions_total", REPLICA, BY_REPLICA), "{{replica}}")]),
            panel("Swap bytes", "Host memory holding the KV of sequences preempted by swap.", "bytes",
                  [query(f"vattn:kv_swap_bytes{{{w}}}", WORKER_LEGEND)]),
        ]),
        ("Prefix cache", [
            panel("Prefix cache memory", "Physical memory holding cached prefix blocks (full blocks of finished and "
                  "running requests, kept for later requests that start the same way), against the pool. It is "
                  "given back, least recently used first, when a request needs room.", "bytes", [
                query(f"vattn:kv_prefix_cache_bytes{{{w}}}", f"{WORKER_LEGEND} cached"),
                query(f"vattn:kv_pool_bytes{{{w}}}", f"{WORKER_LEGEND} pool")]),
            panel("Prefix cache hit rate", "Per engine replica: the share of prompt tokens found cached (mapped "
                  "into the new request's slot, not computed) over the rate window.", "percentunit", [query(
                      f"{rate('vattn:prefix_cache_hits_total', REPLICA, BY_REPLICA)} / "
                      f"{rate('vattn:prefix_cache_queries_total', REPLICA, BY_REPLICA)}", "{{replica}}")],
                  max_value=1),
        ]),
    ])


def serving() -> Dashboard:
    """Per model: the request queue, latencies, throughput, finish reasons and how busy the engine is."""
    s, by = SERVING, BY_MODEL
    return dashboard("vattn-serving", "vattn: serving",
                     "vattn's OpenAI-compatible serving, per model: requests, latency, throughput, finish reasons. "
                     "The metrics are vLLM v1's with the vattn: prefix.", False, [
        ("Requests", [
            panel("Requests running / waiting / swapped", "Requests running (holding KV memory), waiting to be "
                  "scheduled (those preempted by recompute included), and preempted by swap.", "none", [
                query(f"sum by ({by}) (vattn:num_requests_running{{{s}}})", "{{model_name}} running"),
                query(f"sum by ({by}) (vattn:num_requests_waiting{{{s}}})", "{{model_name}} waiting"),
                query(f"sum by ({by}) (vattn:num_requests_swapped{{{s}}})", "{{model_name}} swapped")]),
            panel("KV cache usage", "Per engine replica: the fraction of the tightest worker's KV pages held by "
                  "running requests. Near 100%, requests queue and preemptions start.", "percentunit",
                  [query(f"vattn:kv_cache_usage_perc{{{s}}}", "{{model_name}} {{replica}}")], max_value=1),
            panel("Finish reasons per second", "Requests ended per second, by how: stop (a stop token or "
                  "string), length (max_tokens or the context), abort (the client went away), error.", "reqps",
                  [query(rate("vattn:request_success_total", s, f"{by}, finished_reason"),
                         "{{model_name}} {{finished_reason}}")]),
            panel("Errors per second", "Requests that ended in an error per second; anything above zero "
                  "deserves a look at the server's log.", "reqps",
                  [query(rate("vattn:request_success_total", f'{s}, finished_reason="error"', by),
                         "{{model_name}}")]),
        ]),
        ("Latency", [
            panel("Time to first token p50 / p99", "Arrival to the first token: queueing plus the prefill.", "s",
                  quantiles("vattn:time_to_first_token_seconds", s, by, "{{model_name}}")),
            panel("Inter-token latency p50 / p99", "Time between two tokens of one sequence: the decode step "
                  "time as a client sees it.", "s",
                  quantiles("vattn:inter_token_latency_seconds", s, by, "{{model_name}}")),
            panel("End-to-end latency p50 / p99", "Arrival to the end of the request, whatever its finish "
                  "reason.", "s", quantiles("vattn:e2e_request_latency_seconds", s, by, "{{model_name}}")),
            panel("Queue time p50 / p99", "Arrival to the first schedule: how long requests wait for KV memory "
                  "and a batch slot.", "s",
                  quantiles("vattn:request_queue_time_seconds", s, by, "{{model_name}}")),
            panel("Serving path p50 / p99", "What a client's time to first token holds beyond the engine's: the "
                  "way in (the HTTP front taking a request in, to the engine queueing it) and the first token's "
                  "pickup (the engine buffering it, to the front's poll taking it).", "s",
                  quantiles("vattn:request_ingress_seconds", s, by, "{{model_name}} in")
                  + quantiles("vattn:first_token_pickup_seconds", s, by, "{{model_name}} pickup")),
            # The mean, not quantiles: the counts are small whole numbers, which a quantile interpolated within a
            # bucket misreads (all 1 reads as a p50 of 0.5).
            panel("Steps a stream's poll takes, mean", "How many engine steps' tokens of a streamed request the "
                  "HTTP front's poll took at once: 1 while the fronts keep up with the steps; more, and streams reach "
                  "their clients that many tokens at a time (more ingress replicas share the streams).", "none",
                  [query(f"{rate('vattn:stream_outputs_per_poll_sum', s, by)} / "
                         f"{rate('vattn:stream_outputs_per_poll_count', s, by)}", "{{model_name}}")]),
        ]),
        ("Throughput", [
            panel("Prompt and generation tokens per second", "Prompt tokens (of requests that got their first "
                  "token) and generated tokens (every parallel sample counts) per second.", "suffix: tok/s", [
                query(rate("vattn:prompt_tokens_total", s, by), "{{model_name}} prompt"),
                query(rate("vattn:generation_tokens_total", s, by), "{{model_name}} generation")]),
            panel("Engine busy fraction", "Per engine replica: the share of wall time spent in engine steps "
                  "(scheduling and the workers' round trip). Near 100%, the engine is the bottleneck.",
                  "percentunit", [query(rate("vattn:engine_step_seconds_total", s, BY_REPLICA),
                                        "{{model_name}} {{replica}}")], max_value=1),
            panel("Prefix cache hit rate", "The share of prompt tokens found in the prefix cache (their K/V "
                  "mapped, not computed) over the rate window: system prompts, conversation history and documents "
                  "that requests resend.", "percentunit", [query(
                      f"{rate('vattn:prefix_cache_hits_total', s, by)} / {rate('vattn:prefix_cache_queries_total', s, by)}",
                      "{{model_name}}")], max_value=1),
        ]),
    ])


def render() -> dict[str, str]:
    """File name -> the dashboard's JSON, as written."""
    return {name: json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
            for name, build in [("kv-memory.json", kv_memory), ("serving.json", serving)]}


def main(argv: list[str] | None = None) -> int:
    """Write the dashboards, or with ``--check`` say which differ from a fresh build (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file differs from a fresh build")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    for name in stale:
        print(f"dashboards/{name} differs from a fresh build: run python dashboards/build.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
