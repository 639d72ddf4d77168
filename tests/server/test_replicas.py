"""Two engine replicas behind one ingress (data parallel): requests are spread over both, a replica short of KV
memory gets no new ones, each replica has its own scheduler and workers, and each one's metrics carry its own
``replica`` label; /health speaks for both."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from cluster.config import EngineConfig
from server.app import AppConfig, build_app
from server.routing import STATS_PERIOD_S
from tests.server.conftest import serving


@pytest.fixture(scope="module")
def url():
    # 512 pages of 8 tokens: one long request holds a large share of a replica's KV memory
    engine = EngineConfig(model="tiny", device="cpu", kv_memory=4 << 20, max_model_len=2048, page_size=4096,
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


def per_replica(metrics: str, name: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(rf'^vattn:{name}{{model_name="tiny",replica="(\w+)"}} (\S+)$', metrics, re.M)}


def test_a_replica_short_of_kv_memory_gets_no_new_requests(url):
    """One replica holds a long request (a quarter of its pages, then more); every request after it goes to the
    other. (Serve's default router would pick at random here: a request is no Serve call while it runs.)"""
    stop = threading.Event()

    def hog() -> None:
        body = {"model": "tiny", "prompt": "x" * 1000, "max_tokens": 1040, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # closing the stream aborts the request

    thread = threading.Thread(target=hog)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            usage = per_replica(httpx.get(f"{url}/metrics").text, "kv_cache_usage_perc")
            if full := [r for r, u in usage.items() if u > 0.2]:
                break
            assert time.monotonic() < deadline and thread.is_alive(), usage
            time.sleep(0.05)
        (full,) = full
        time.sleep(3 * STATS_PERIOD_S)  # the router has the replica's report
        before = per_replica(httpx.get(f"{url}/metrics").text, "prompt_tokens_total")

        def small(k: int) -> int:
            return httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": f"small {k}", "max_tokens": 2, "temperature": 0}).status_code

        with ThreadPoolExecutor(8) as pool:  # at once: by count alone the hog's replica soon looks the less loaded
            assert list(pool.map(small, range(8))) == [200] * 8
        after = per_replica(httpx.get(f"{url}/metrics").text, "prompt_tokens_total")
        assert thread.is_alive()  # the hog ran all along
    finally:
        stop.set()
        thread.join(60)
    moved = {r: after.get(r, 0) - before.get(r, 0) for r in after}
    assert moved[full] == 0 and sum(moved.values()) == 8 * len("small 0"), moved


def test_health_speaks_for_every_replica(url):
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert len(r.json()["replicas"]) == 2 and set(r.json()["replicas"].values()) == {"ok"}


def test_requests_that_share_a_prefix_go_to_the_replica_that_cached_it(url):
    """Chats with one long system prompt: after the first, each goes where that prompt's pages are cached and maps
    them (prefix hits there, none elsewhere), though by load alone the router would alternate."""
    system = "You answer questions about the solar system, briefly, in plain words, for a curious child. " * 4
    before = httpx.get(f"{url}/metrics").text
    for k in range(8):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {k}?"}]})
        assert r.status_code == 200, r.text
        time.sleep(2 * STATS_PERIOD_S)  # each replica has reported: load alone would not pick one replica 8 times
    after = httpx.get(f"{url}/metrics").text
    prompts = {r: n - per_replica(before, "prompt_tokens_total").get(r, 0)
               for r, n in per_replica(after, "prompt_tokens_total").items()}
    hits = {r: n - per_replica(before, "prefix_cache_hits_total").get(r, 0)
            for r, n in per_replica(after, "prefix_cache_hits_total").items()}
    (served,) = [r for r, n in prompts.items() if n > 0]  # one replica took all eight
    assert hits[served] >= 7 * len(system) * 0.9, (hits, prompts)  # the seven after the first found the prompt
