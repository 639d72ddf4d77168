"""The Ray head's GCS killed under streaming load and restarted, with and without GCS fault tolerance.

A real ``redis-server`` (Debian's) holds the GCS's tables when ``RAY_REDIS_ADDRESS`` names it (what the chart's
``gcsFaultTolerance`` values and ``vattn serve`` use); the GCS process of a real local Ray cluster serving the
``tiny`` model is killed while streams run and requests arrive, then started again. With Redis the restarted GCS
takes the cluster back: Serve's control plane answers again and nothing leaked. Without it the data plane keeps
answering on the actors it has, but the new GCS is another cluster to every process: the control plane is gone for
good (in a pod, KubeRay restarts the head and every replica with it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import ray
from ray import serve

from server.serve_env import free_local_port
from tests.server.conftest import stream_to_end, tiny_server
from tests.server.test_openai_api import engine_snapshot


@contextmanager
def redis_server() -> Iterator[str]:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (`apt-get install redis-server`; `make test` installs it)")
    port = free_local_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG":
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def through_an_outage(url: str, outage_s: float = 3.0) -> tuple[list, list[int], list[int]]:
    """Four streams in flight and one request a second while the GCS is down for ``outage_s``; the streams' ends,
    the status codes during the outage and of three requests after it."""
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 12, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    ends: list = []
    streams = [threading.Thread(target=stream_to_end, args=(url, ends, {"max_tokens": 150})) for _ in range(4)]
    for t in streams:
        t.start()
    time.sleep(0.3)
    node = ray._private.worker._global_node
    node.kill_gcs_server()
    during, start = [], time.monotonic()
    while time.monotonic() - start < outage_s:
        during.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code)  # a hang fails here
        time.sleep(1)
    node.start_gcs_server()
    for t in streams:
        t.join(90)
    after = [httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code for _ in range(3)]
    return ends, during, after


def test_with_redis_the_app_serves_through_a_gcs_restart_and_its_control_plane_comes_back(monkeypatch):
    with redis_server() as address:
        monkeypatch.setenv("RAY_REDIS_ADDRESS", address)
        with tiny_server() as target:
            ends, during, after = through_an_outage(f"http://{target}")
            assert ends == [("done", "length")] * 4
            assert set(during) == {200} and after == [200] * 3
            assert {name: a.status for name, a in serve.status().applications.items()} == {"default": "RUNNING"}
            deadline = time.monotonic() + 20
            while (snap := engine_snapshot()).requests and time.monotonic() < deadline:
                time.sleep(0.05)
            assert snap.requests == () and all(w.slots_in_use == 0 for w in snap.workers)


def test_with_redis_a_worker_lost_while_the_gcs_is_down_is_rebuilt_once_it_is_back(monkeypatch):
    """The rebuild needs new actors and a placement group, which only the GCS gives: it waits for the GCS instead
    of failing the engine. The stream in flight on the lost worker ends with an error event, a request sent during
    the outage is served once the group is back, and nothing leaked."""
    with redis_server() as address:
        monkeypatch.setenv("RAY_REDIS_ADDRESS", address)
        # A stream long enough to be in flight when its worker goes, which goes as soon as the stream has begun: one of
        # 240 tokens, 0.5 s after it was sent, had ended before the kill (CI, 2026-11-28; CPU decode steps got faster)
        with tiny_server(max_model_len=2100) as target:
            url = f"http://{target}"
            body = {"model": "tiny", "prompt": "hello world", "max_tokens": 12, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            (worker,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("vattn-worker-")]
            pid = ray.get(ray.get_actor(worker["name"], namespace=worker["namespace"]).__ray_call__.remote(lambda _: os.getpid()))
            ends: list = []
            started = threading.Event()
            stream = threading.Thread(target=stream_to_end, args=(url, ends, {"max_tokens": 2000}, started))
            stream.start()
            assert started.wait(30)
            ray._private.worker._global_node.kill_gcs_server()
            os.kill(pid, signal.SIGKILL)  # ray.kill needs the GCS
            during: list[int] = []
            sender = threading.Thread(target=lambda: during.append(
                httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code))
            sender.start()
            time.sleep(3)
            assert not during  # waiting for the group, not failed
            ray._private.worker._global_node.start_gcs_server()
            for t in (stream, sender):
                t.join(60)
            assert len(ends) == 1 and ends[0][0] == "error" and "the worker group failed and was rebuilt" in ends[0][1], ends
            assert during == [200]
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            snap = engine_snapshot()
            assert snap.num_rebuilds == 1 and snap.requests == () and all(w.slots_in_use == 0 for w in snap.workers)


def test_without_redis_the_restarted_gcs_is_another_cluster_to_serve():
    with tiny_server() as target:
        ends, during, after = through_an_outage(f"http://{target}")
        assert set(during) == {200}  # the replicas answer on the actors they have...
        with pytest.raises(Exception, match="WrongClusterID"):  # ... but Serve's controller has lost its cluster
            serve.status()
