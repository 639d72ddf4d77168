"""The Grafana dashboards (``dashboards/build.py``): the committed JSON is a fresh build, every panel queries only
documented metrics through the dashboard's variables, and a real Prometheus (Debian's) scraping a live server under
traffic returns data for every panel's query and every variable. No Grafana runs here: the test substitutes the
variables as Grafana would for "All" (``.*``) or one model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.prometheus import PROMETHEUS, prometheus
from tests.server.conftest import send_completions, stream_to_end, tiny_server

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "metrics.md"
METRIC = re.compile(r"vattn:[a-z0-9_:]+")
# Grafana's $__rate_interval is at least four scrape intervals; 30s keeps a few seconds of traffic in the window.
RATE_INTERVAL = "30s"
VARIABLE_VALUES = {"namespace": [], "model": ["tiny"], "pp_rank": ["0"], "tp_rank": ["0"]}


def load(name: str):
    """``dashboards/<name>.py`` (a script directory, not a package)."""
    spec = importlib.util.spec_from_file_location(f"dashboards_{name}", ROOT / "dashboards" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BUILD = load("build")
PREVIEW = load("preview")
DASHBOARDS = {name: json.loads(text) for name, text in BUILD.render().items()}


def documented() -> set[str]:
    """The metric names ``docs/metrics.md`` tabulates."""
    return set(re.findall(r"^\| `(vattn:[a-z0-9_:]+)` \|", DOC.read_text(), re.M))


def exprs(panel: dict) -> list[str]:
    return [t["expr"] for t in panel.get("targets", []) if t.get("expr")]


def substitute(text: str, model: str) -> str:
    """``text`` with the dashboard variables replaced as Grafana does for "All" everywhere but ``$model``."""
    out = PREVIEW.substitute(text, {"__rate_interval": RATE_INTERVAL, "model": model})
    assert "$" not in out, out
    return out


def test_the_committed_json_is_a_fresh_build():
    for name, text in BUILD.render().items():
        assert (ROOT / "dashboards" / name).read_text() == text, f"run: python dashboards/build.py ({name} is stale)"
    assert BUILD.main(["--check"]) == 0


def test_dashboards_identity_and_variables():
    assert {d["uid"] for d in DASHBOARDS.values()} == {"vattn-kv-memory", "vattn-serving"}
    for name, d in DASHBOARDS.items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        expected = {"datasource", "namespace", "model"} | ({"replica", "pp_rank", "tp_rank"} if name == "kv-memory.json"
                                                            else set())
        assert set(variables) == expected, name
        for v in variables.values():
            if v["type"] == "query":
                assert v["includeAll"] and v["multi"] and v["allValue"] == ".*", v["name"]
                assert v["datasource"]["uid"] == "${datasource}", v["name"]


def test_every_panel_queries_documented_metrics_through_the_variables():
    names, problems = documented(), []
    for name, d in DASHBOARDS.items():
        for p in PREVIEW.charts(d):
            if not exprs(p):
                problems.append(f"{name} {p['title']!r}: no query")
            if p["datasource"]["uid"] != "${datasource}" or not p.get("description") \
                    or not p["fieldConfig"]["defaults"].get("unit"):
                problems.append(f"{name} {p['title']!r}: datasource, description or unit missing")
            for expr in exprs(p):
                used = {re.sub(r"_(bucket|count|sum)$", "", m) for m in METRIC.findall(expr)}
                if used - names:
                    problems.append(f"{name} {p['title']!r}: undocumented {sorted(used - names)}")
                # every selector filters by namespace and model (a metric name is always followed by its selector)
                for selector in re.findall(r"vattn:[a-z0-9_:]+(\{[^}]*\})?", expr):
                    if 'namespace=~"$namespace"' not in selector or 'model_name=~"$model"' not in selector:
                        problems.append(f"{name} {p['title']!r}: unfiltered selector in {expr}")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def server():
    with tiny_server(kv_memory=8 << 20) as target:  # 8K tokens: the mixed traffic below preempts
        yield target


def traffic(target: str) -> None:
    send_completions(target, "dashboard", 4)
    done: list = []
    stream_to_end(f"http://{target}", done, {"max_tokens": 12})  # a stream's polls (stream_outputs_per_poll)
    assert done == [("done", "length")], done


def mixed_traffic(target: str, seconds: float) -> float:
    """Waves of 1 to 24 concurrent streams of varied lengths (some n=2) for ``seconds``; the minutes to draw."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    rng = random.Random(0)

    def one(k: int) -> None:
        # tiny's tokens are bytes: up to 150 prompt and 100 output tokens, within its 256
        body = {"model": "tiny", "prompt": "word " * rng.randint(2, 30), "max_tokens": rng.randint(8, 100),
                "temperature": 0.8, "n": 1 + k % 2, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"http://{target}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for _ in r.iter_lines():
                pass

    start = time.monotonic()
    with ThreadPoolExecutor(24) as pool:
        wave = 0
        while time.monotonic() - start < seconds:
            list(pool.map(one, range(1 + (wave * 7) % 24)))
            wave += 1
            time.sleep(rng.uniform(0, 3))
    return (time.monotonic() - start) / 60 + 0.5


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (apt-get install prometheus)")
def test_every_panel_returns_data_from_a_live_server(server, tmp_path):
    with prometheus(server, tmp_path) as prom:
        # rates need two samples in the window, and some traffic in it to be more than zero
        moving = f"rate(vattn:generation_tokens_total[{RATE_INTERVAL}]) > 0"
        deadline = time.monotonic() + 90
        while not prom.query(moving) and time.monotonic() < deadline:
            traffic(server)
            time.sleep(1)
        assert prom.query(moving), "no generation tokens reached Prometheus"
        traffic(server)
        time.sleep(2.5)  # two scrapes

        empty = []
        for name, d in DASHBOARDS.items():
            for model in ("tiny", ".*"):
                for p in PREVIEW.charts(d):
                    for expr in exprs(p):
                        q = substitute(expr, model)
                        if not prom.query(q):
                            empty.append(f"{name} {p['title']!r} (model {model}): {q}")
        assert not empty, "panels without data:\n" + "\n".join(empty)

        # Drawn from the same JSON and data (dashboards/preview.py): every panel has a line or a value to show.
        # VATTN_PREVIEW=docs: after a few minutes of mixed traffic, the pictures docs/deploy.md shows.
        out = Path(os.environ.get("VATTN_PREVIEW") or tmp_path)
        minutes = 1.0
        if os.environ.get("VATTN_PREVIEW"):
            minutes = mixed_traffic(server, seconds=240)
        for name, d in DASHBOARDS.items():
            counts = PREVIEW.render(d, prom.api, out / name.replace(".json", ".png"), minutes,
                                    {"__rate_interval": RATE_INTERVAL})
            assert all(counts.values()) and len(counts) == len(PREVIEW.charts(d)), (name, counts)

        # the variables' own queries list what the panels filter on; no namespace label outside Kubernetes (hence
        # All = .*), one engine replica of one worker here
        for d in DASHBOARDS.values():
            for v in d["templating"]["list"]:
                if v["type"] == "query":
                    match, label = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]).groups()
                    values = prom.label_values(label, substitute(match, "tiny"))
                    if v["name"] == "replica":
                        assert len(values) == 1, values
                    else:
                        assert values == VARIABLE_VALUES[v["name"]], (v["name"], values)
