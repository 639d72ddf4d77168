"""A real Serve app on loopback for the server tests: local Ray, one free port, torn down after."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import ray
from ray import serve
from ray.serve import Application

from cluster.config import EngineConfig
from server.app import AppConfig, build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(build: Callable[[], Application], num_cpus: int = 4, **run) -> Iterator[str]:
    """Start Ray and Serve, run the application ``build()`` makes (after Ray is up), yield its base URL."""
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(), **{"route_prefix": "/", **run})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def tiny_app() -> Application:
    """The ``tiny`` preset on CPU, one engine replica: what the metrics and dashboard tests scrape."""
    return build_app(AppConfig(EngineConfig(model="tiny", device="cpu", kv_memory=64 << 20, max_model_len=256,
                                            page_size=4096, distributed="ray")))
