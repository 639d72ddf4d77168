"""Debian's ``prometheus`` scraping one target, for the tests that check metrics and queries against live data."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from server.serve_env import free_local_port

PROMETHEUS = shutil.which("prometheus")


class Prometheus:
    """The HTTP API of a running Prometheus."""

    def __init__(self, api: str):
        self.api = api

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` evaluates to now; raises on a query Prometheus refuses."""
        r = httpx.get(f"{self.api}/query", params={"query": expr}, timeout=10)
        body = r.json()
        if body["status"] != "success":
            raise ValueError(f"{expr}: {body.get('error')}")
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's ``label_values(match, label)`` lists."""
        r = httpx.get(f"{self.api}/label/{label}/values", params={"match[]": match}, timeout=10)
        return r.json()["data"]


@contextmanager
def prometheus(target: str, workdir: Path, scrape_interval: str = "1s") -> Iterator[Prometheus]:
    """Run Prometheus scraping ``target`` (host:port, path ``/metrics``) every ``scrape_interval``, its config
    and data under ``workdir``; yield it once it is ready."""
    config = workdir / "prometheus.yml"
    config.write_text(f"global: {{scrape_interval: {scrape_interval}}}\nscrape_configs:\n  - job_name: vattn\n"
                      f"    static_configs: [{{targets: ['{target}']}}]\n")
    port = free_local_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/-/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield Prometheus(f"{base}/api/v1")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
