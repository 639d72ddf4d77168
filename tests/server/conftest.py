"""A real Serve app on loopback for the server tests: local Ray, one free port, torn down after."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import ray
from ray import serve
from ray.serve import Application

from cluster.config import EngineConfig
from server.app import AppConfig, build_app
from server.serve_env import free_local_port, local_cluster_env


@contextmanager
def serving(build: Callable[[], Application], num_cpus: int = 4, **run) -> Iterator[str]:
    """Start Ray and Serve (the data plane ``vattn serve`` uses), run the application ``build()`` makes (after Ray is
    up), yield its base URL."""
    local_cluster_env()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        port = free_local_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(), **{"route_prefix": "/", **run})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def tiny_server(kv_memory: int = 64 << 20, max_model_len: int = 256) -> Iterator[str]:
    """The ``tiny`` preset on CPU, one engine replica, served; yields its ``host:port`` (what the metrics and
    dashboard tests point Prometheus at)."""
    engine = EngineConfig(model="tiny", device="cpu", kv_memory=kv_memory, max_model_len=max_model_len, page_size=4096,
                          distributed="ray")
    with serving(lambda: build_app(AppConfig(engine))) as url:
        yield url.removeprefix("http://")


def send_completions(target: str, word: str, count: int) -> None:
    """``count`` greedy completions of 12 tokens, every other one with n=2 (so both counters and forks move)."""
    for k in range(count):
        r = httpx.post(f"http://{target}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": f"{word} " * (k + 1), "max_tokens": 12, "temperature": 0, "n": 1 + k % 2})
        assert r.status_code == 200, r.text


def stream_to_end(url: str, out: list, body: dict, started: threading.Event | None = None) -> None:
    """One streamed greedy completion of ``tiny`` (``body`` on top) into ``out``: ("done", its finish reason) when it
    ran to its end, ("error", message) for an error event, ("cut", None) for a stream that just stopped; ``started``
    is set at its first event."""
    finish = None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "a b c", "temperature": 0, "ignore_eos": True, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.append(("done", finish))
                return
            event = json.loads(line[6:])
            if started is not None:
                started.set()
            if "error" in event:
                out.append(("error", event["error"]["message"]))
                return
            finish = event["choices"][0]["finish_reason"] or finish
    out.append(("cut", None))
