"""bench/serving.py's reading of a server's own latency histograms (vLLM's names, or vattn's prefix on them), from
an exposition prometheus_client writes; its refusal of text prompts it cannot write."""

from __future__ import annotations

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
