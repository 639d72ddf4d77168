"""A real Prometheus (Debian's ``prometheus``) scrapes a live server under traffic: every metric that
``docs/metrics.md`` documents reaches it, the counters moved, and what ``/metrics`` exposes is documented."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.prometheus import PROMETHEUS, prometheus
from tests.server.conftest import send_completions, tiny_server

DOC = Path(__file__).parents[2] / "docs" / "metrics.md"


def documented() -> dict[str, str]:
    """name -> type, from the tables."""
    return dict(re.findall(r"^\| `(vattn:[a-z0-9_:]+)` \| (gauge|counter|histogram) \|", DOC.read_text(), re.M))


@pytest.fixture(scope="module")
def server():
    with tiny_server() as target:
        yield target


def traffic(target: str) -> None:
    send_completions(target, "metrics", 6)


def test_what_metrics_exposes_is_documented(server):
    traffic(server)
    text = httpx.get(f"http://{server}/metrics").text
    exposed = {re.sub(r"_(bucket|count|sum)$", "", line.split("{")[0]) for line in text.splitlines()
               if line.startswith("vattn:")}
    assert exposed == set(documented())
    assert re.search(r'^vattn:request_success_total\{finished_reason="length",model_name="tiny",replica="\w+"\} 6\.0$',
                     text, re.M)


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (make test installs it where it can)")
def test_prometheus_scrapes_every_documented_metric(server, tmp_path):
    with prometheus(server, tmp_path) as prom:
        query = prom.query
        deadline = time.monotonic() + 60
        while not query("vattn:generation_tokens_total > 0") and time.monotonic() < deadline:
            traffic(server)
            time.sleep(1)
        before = float(query("vattn:generation_tokens_total")[0]["value"][1])
        traffic(server)
        time.sleep(2.5)  # two scrapes
        missing = []
        for name, kind in sorted(documented().items()):
            q = f"{name}_count" if kind == "histogram" else name
            if not query(q):
                missing.append(q)
        assert not missing, f"not in Prometheus: {missing}"
        assert float(query("vattn:generation_tokens_total")[0]["value"][1]) > before  # counters moved
        assert float(query('sum(vattn:request_success_total{finished_reason="length"})')[0]["value"][1]) >= 12
        assert float(query("vattn:time_to_first_token_seconds_count")[0]["value"][1]) >= 12
        # the serving path's share of TTFT: every request's way in, and its first token's pickup
        assert float(query("vattn:request_ingress_seconds_count")[0]["value"][1]) >= 12
        assert float(query("vattn:first_token_pickup_seconds_count")[0]["value"][1]) >= 12
        assert float(query("vattn:prompt_tokens_total")[0]["value"][1]) > 0
        assert float(query("sum(vattn:kv_pages_mapped_total)")[0]["value"][1]) > 0
        (worker,) = query("vattn:kv_mapped_bytes")
        assert worker["metric"]["pp_rank"] == "0" and worker["metric"]["model_name"] == "tiny"
