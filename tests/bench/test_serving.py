"""bench/serving.py's reading of a server's own latency histograms (vLLM's names, or vattn's prefix on them), from
an exposition prometheus_client writes; its refusal of text prompts it cannot write; its offline run of the same
prompts through the engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import serving  # noqa: E402


@pytest.mark.parametrize("prefix", ["vllm", "vattn"])
def test_engine_means_are_the_servers_histograms_over_a_level(prefix):
    registry = CollectorRegistry()
    ttft = Histogram(f"{prefix}:time_to_first_token_seconds", "ttft", ["engine"], registry=registry)
    queue = Histogram(f"{prefix}:request_queue_time_seconds", "queue", ["engine"], registry=registry)
    Histogram(f"{prefix}:iteration_tokens_total", "not a latency", registry=registry).observe(5)
    ttft.labels("0").observe(1.0)
    before = serving.engine_totals(generate_latest(registry).decode())
    for replica, seconds in (("0", 0.2), ("1", 0.4), ("1", 0.6)):  # two replicas' label sets add up
        ttft.labels(replica).observe(seconds)
    queue.labels("0").observe(0.1)
    after = serving.engine_totals(generate_latest(registry).decode())
    assert set(after) == {"time_to_first_token_seconds", "request_queue_time_seconds"}
    means = serving.engine_means(before, after)
    assert means["time_to_first_token_seconds"] == pytest.approx(0.4)
    assert means["request_queue_time_seconds"] == pytest.approx(0.1)
    assert means["e2e_request_latency_seconds"] is None  # the server has none: no requests counted


def test_text_prompts_need_a_real_tokenizer():
    # The byte tokenizer of a preset decodes random ids to no text of the asked length (empty prompts at --vocab
    # 32000): refused before a server starts.
    done = subprocess.run([sys.executable, str(Path(serving.__file__)), "--model", "llama-3-8b", "--text"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert ("--text needs a model directory with a tokenizer.json (--tokenizer, or --model with --load-format dummy); "
            "'llama-3-8b' has the byte tokenizer") in done.stderr


def test_offline_runs_each_closed_loop_levels_prompts_through_the_engine_at_once(tmp_path):
    # vattn serve's engine (LLM on a real local Ray) on the prompts the clients would send: every request ran whole.
    done = subprocess.run([sys.executable, str(Path(serving.__file__)), "--offline", "--model", "tiny", "--device", "cpu",
                           "--kv-memory", "64MiB", "--concurrency", "2", "8", "--rounds", "3", "--input", "12",
                           "--output", "5", "--name", "offline", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "offline.json").read_text())
    assert result["offline"] is True
    assert [(x["concurrency"], x["requests"], x["output_tokens"]) for x in result["levels"]] == [(2, 16, 80), (8, 24, 120)]
    assert all(x["output_tok_s"] > 0 for x in result["levels"])


def test_offline_refuses_what_has_no_offline_meaning():
    done = subprocess.run([sys.executable, str(Path(serving.__file__)), "--offline", "--rates", "4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--offline runs the closed-loop levels' token ids through the engine here: no --url, --rates, --text" in done.stderr
