"""OutputCollector, the ingress's side of its calls, over a real scheduler actor: calls that come together reach it in
one actor call and each hears its own answer; a call whose caller left while it was on its way is aborted; text is
tokenized off the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ray

from cluster.engine import LLM
from server.engine import SchedulerRef
from server.outputs import OutputCollector
from worker.sampling import SamplingParams

FOUR = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with LLM("tiny", distributed="ray", device="cpu", kv_memory=8 << 20, max_num_seqs=8, max_model_len=128,
                 page_size=4096) as engine:
            yield engine
    finally:
        ray.shutdown()


def direct_collector(llm: LLM, consumer: str) -> OutputCollector:
    """The ingress of a deployment with one engine replica, once a call through Serve named its scheduler."""
    engine = llm._engine
    collector = OutputCollector(None, consumer, engine.tokenizer, engine.plan.model.vocab_size, direct=True)
    collector._scheduler = SchedulerRef("replica-0", engine.actor)
    return collector


async def finals(collector: OutputCollector, prompt: list[int]) -> list:
    return [p async for batch in collector.generate([prompt], FOUR, False) for p in batch]


def test_calls_that_come_together_are_each_answered_a_bad_ones_error_its_own(llm):
    collector = direct_collector(llm, "ingress-burst")

    async def burst():
        return await asyncio.gather(*(finals(collector, [100 + i, 7, 8]) for i in range(24)),
                                    finals(collector, [5, 1 << 20]), return_exceptions=True)

    results = asyncio.run(burst())
    assert isinstance(results[-1], ValueError) and "prompt token ids" in str(results[-1])
    for done in results[:-1]:
        [progress] = done
        assert progress.output.finished and len(progress.output.outputs[0].token_ids) == 4
    assert ray.get(llm._engine.actor.in_flight.remote()) == 0


def test_a_call_whose_caller_left_on_its_way_is_aborted(llm):
    collector = direct_collector(llm, "ingress-gone")
    many = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def leave():
        outputs = collector.generate([[9, 10, 11]], many, True)
        task = asyncio.ensure_future(outputs.__anext__())
        await asyncio.sleep(0)  # the call is on its way to the scheduler
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1)  # the call comes back: its requests are aborted

    asyncio.run(leave())
    seen, deadline = [], time.monotonic() + 30
    while not any(o.finished for o in seen) and time.monotonic() < deadline:
        seen += ray.get(llm._engine.actor.wait_outputs.remote(None, 5.0, "ingress-gone"))
    [final] = [o for o in seen if o.finished]
    assert final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) < 100


class GatedTokenizer:
    """The engine's tokenizer, whose batch encodes wait until ``opened`` is set (by a coroutine on the loop)."""

    def __init__(self, inner):
        self.inner, self.opened = inner, threading.Event()

    def encode_batch(self, texts, add_special_tokens=True):
        assert self.opened.wait(10), "tokenized on the event loop: nothing else could run meanwhile"
        return self.inner.encode_batch(texts, add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_text_is_tokenized_off_the_event_loop_and_gives_what_its_ids_give(llm):
    collector = direct_collector(llm, "ingress-text")
    gate = collector.tokenizer = GatedTokenizer(collector.tokenizer)

    async def both():
        async def text_call():
            return [p async for batch in collector.generate(["hi there", [5, 6]], FOUR, False) for p in batch]

        async def open_gate():
            await asyncio.sleep(0.05)  # runs only if the loop is free while the tokenizer waits
            gate.opened.set()

        text, _ = await asyncio.gather(text_call(), open_gate())
        return text, await finals(collector, list(b"hi there"))

    # One loop for both calls: a poll the scheduler actor still serves for a closed loop would take the next outputs
    text, [alone] = asyncio.run(asyncio.wait_for(both(), 60))
    by_index = {p.index: p.output for p in text}
    assert list(by_index[0].prompt_token_ids) == list(b"hi there") and list(by_index[1].prompt_token_ids) == [5, 6]
    assert by_index[0].outputs[0].token_ids == alone.output.outputs[0].token_ids
