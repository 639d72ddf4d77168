"""A benchmark counts tokens only of requests that ran whole: a failed request (a worker group rebuilt mid-run) or
one short of its tokens stops the run with the reason, where its missing tokens would have passed for speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import report  # noqa: E402
from cluster.engine import LLM  # noqa: E402
from cluster.outputs import RequestOutput  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def outputs():
    with LLM("tiny", kv_memory=16 << 20, max_num_seqs=4, max_model_len=64, page_size=4096, device="cpu") as llm:
        return llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))


def test_whole_runs_count_their_tokens(outputs):
    assert report.generated_tokens(outputs, 4) == 8
    assert report.generated_tokens(outputs) == 8


def test_a_completion_short_of_its_tokens_stops_the_run(outputs):
    with pytest.raises(RuntimeError, match=r"request 0 ended after 4 of 5 tokens \(finish_reason 'length'\)"):
        report.generated_tokens(outputs, 5)


def test_a_failed_request_stops_the_run_with_its_error(outputs):
    failed = RequestOutput.failed("2", "the worker group failed and was rebuilt", n=1)
    with pytest.raises(RuntimeError, match="1 of 3 requests failed; the first: the worker group failed and was rebuilt"):
        report.generated_tokens([*outputs, failed], 4)
