"""Two engine replicas behind one ingress (data parallel): requests are spread over both, each replica has its
own scheduler and workers, and each one's metrics carry its own ``replica`` label."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from cluster.config import EngineConfig
from server.app import AppConfig, build_app
from tests.server.conftest import serving


@pytest.fixture(scope="module")
def url():
    engine = EngineConfig(model="tiny", device="cpu", kv_memory=64 << 20, max_model_len=256, page_size=4096,
                          distributed="ray")
    with serving(lambda: build_app(AppConfig(engine, num_replicas=2)), num_cpus=6) as base:
        yield base


def test_requests_spread_over_both_replicas_and_metrics_say_whose(url):
    def complete(k: int) -> str:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": f"request {k}", "max_tokens": 48, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(complete, range(32)))
    assert len(texts) == 32
    metrics = httpx.get(f"{url}/metrics").text
    done = {m[0]: float(m[1]) for m in re.findall(
        r'^vattn:request_success_total\{finished_reason="length",model_name="tiny",replica="(\w+)"\} (\S+)$', metrics, re.M)}
    assert len(done) == 2 and sum(done.values()) == 32
    assert all(n > 0 for n in done.values()), done  # both served
    workers = re.findall(r'^vattn:kv_total_pages\{model_name="tiny",pp_rank="0",replica="(\w+)",tp_rank="0"\}', metrics, re.M)
    assert sorted(workers) == sorted(done)  # each replica's own worker
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 2  # one per engine replica, its worker inside
