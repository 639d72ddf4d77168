"""GET /dashboard in a real browser (Debian's headless Chromium) on a live server with requests holding pages:
the page draws each slot's pages (used, shared by the parallel samples' common prompt, kept, reserved) and the
memory series, and makes no request anywhere but the server."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import matplotlib.image
import numpy as np
import pytest

from cluster.config import EngineConfig
from server.app import AppConfig, build_app
from server.dashboard import COLORS
from tests.server.conftest import serving

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def url():
    engine = EngineConfig(model="tiny", device="cpu", kv_memory=4 << 20, max_model_len=2048, page_size=4096,
                          max_num_seqs=16, distributed="ray")
    with serving(lambda: build_app(AppConfig(engine))) as base:
        yield base


@pytest.fixture
def busy(url):
    """Requests holding pages while the test looks: one long, and one of four samples sharing their prompt."""
    stop = threading.Event()
    bodies = ({"prompt": "x" * 600, "max_tokens": 1400}, {"prompt": "y" * 400, "max_tokens": 1500, "n": 4})
    started = [threading.Event() for _ in bodies]  # each request streaming: both hold their pages

    def stream(body: dict, started: threading.Event) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": "tiny", "temperature": 1.0, "ignore_eos": True, "stream": True, **body}) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    return

    threads = [threading.Thread(target=stream, args=pair) for pair in zip(bodies, started)]
    for t in threads:
        t.start()
    assert all(s.wait(60) for s in started)
    yield
    stop.set()
    for t in threads:
        t.join(60)


def test_the_page_draws_used_and_shared_pages_and_loads_nothing_from_elsewhere(url, busy):
    # The samples' own tails appear once each has written past the prompt's pages they share, a few steps after
    # their first tokens streamed (later on a loaded machine): the page is read until it shows them, as a user's
    # refreshing page would.
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(f"{url}/dashboard")
        assert r.status_code == 200
        page = r.text
        if len(re.findall(r'class="pU"', page)) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.headers["content-security-policy"] == "default-src 'none'; style-src 'unsafe-inline'"
    assert len(re.findall(r'class="pU"', page)) >= 4  # the long request and the four samples' own tails
    assert re.search(r'class="pS"', page)  # the samples share their prompt's pages
    assert re.search(r'class="pR"', page)  # ... and each slot's range beyond is reserved only
    assert not re.search(r'\b(src|href)=', page)  # nothing to fetch
    assert "worker pp0 tp0" in page


def page_requests(netlog: dict) -> set[str]:
    """URLs the page's tab fetched: requests whose network isolation key's top frame is the loopback site
    (Chromium's own background fetches are keyed to other sites or to none)."""
    start = netlog["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return {e["params"]["url"] for e in netlog["events"] if e["type"] == start and "params" in e
            and e["params"].get("network_isolation_key", "").startswith("http://127.0.0.1 ")}


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test installs it where it can)")
def test_headless_chromium_shows_mapped_pages_and_requests_only_the_server(url, busy, tmp_path):
    httpx.get(f"{url}/dashboard")  # a first sample of the memory series
    shot, netlog = tmp_path / "dashboard.png", tmp_path / "net.json"
    subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1100,1000", f"--screenshot={shot}", f"--log-net-log={netlog}",
                    f"{url}/dashboard"], check=True, timeout=120, capture_output=True)
    pixels = (matplotlib.image.imread(shot)[..., :3] * 255).round().astype(int)
    green = np.array([int(COLORS["U"][i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(pixels - green).sum(axis=-1) < 8).sum() > 200  # mapped pages drawn
    urls = page_requests(json.loads(netlog.read_text()))
    assert f"{url}/dashboard" in urls and all(u.startswith(url) for u in urls), urls
    if os.environ.get("VATTN_SCREENSHOT"):  # VATTN_SCREENSHOT=docs/dashboard.png: what README shows
        Path(os.environ["VATTN_SCREENSHOT"]).write_bytes(shot.read_bytes())
