"""bench/scheduler_overhead.py: the scheduler alone over the H100 harness's workloads (llama-3-8b's page geometry,
40 GiB of KV). On the shared-prefix workload the prefix cache finds what a cache of 2 MiB pages could at best."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import scheduler_overhead  # noqa: E402


def test_the_shared_prefix_workload_hits_what_its_page_size_allows():
    on = scheduler_overhead.run("prefix", True, 0)
    off = scheduler_overhead.run("prefix", False, 0)
    assert on["hit_rate"] >= 0.95 * on["ideal_hit_rate"] and on["ideal_hit_rate"] > 0.85
    assert on["steps"] < off["steps"] / 4  # 86% of the prompt tokens are not computed: far fewer prefill steps
