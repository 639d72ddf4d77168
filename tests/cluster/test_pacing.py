"""Pacing admissions by the cost of mapping their cached prefixes (``cluster.pacing``): the scheduler admits cached
prefixes up to the step's page budget (always one), the pacer derives that budget from the workers' reports, and
pacing changes when requests start, never their tokens."""

from __future__ import annotations

import random

import torch

from cluster.engine import LLM
from cluster.pacing import PrefixMappingPacer
from cluster.scheduler import Scheduler, SchedulerConfig
from cluster.sequence import Request, Sequence
from kvmem import KVCacheSpec
from kvmem.ledger import PageLedger
from worker.messages import WorkerReport
from worker.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _scheduler() -> Scheduler:
    spec = KVCacheSpec(2, 2, 16, torch.float32, max_slots=16, max_tokens=512, layout="mega", page_size=4096)
    ledger = PageLedger(spec, 400, keeps_pages_on_free=True, caches_prefixes=True)
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096), ledger)


def _add(scheduler: Scheduler, prompt: list[int]) -> Sequence:
    request = Request(str(scheduler.new_seq_id()), None, tuple(prompt), SamplingParams(max_tokens=4), 0)
    seq = Sequence(scheduler.new_seq_id(), request, 0, list(prompt))
    request.seqs.append(seq)
    scheduler.add(seq)
    return seq


def test_the_scheduler_admits_cached_prefixes_up_to_its_page_budget_and_always_one():
    scheduler = _scheduler()
    block = scheduler.kv.spec.tokens_within(1)
    system = list(range(3, 3 + 6 * block))  # six full pages
    _add(scheduler, system + [1])
    scheduler.schedule()  # computes (and caches) the system prompt's pages
    def admitted() -> list[int]:
        before = {seq.seq_id for seq in scheduler.running}
        scheduler.schedule()
        return [seq.seq_id for seq in scheduler.running if seq.seq_id not in before]

    scheduler.prefix_map_budget = 13
    waiting = [_add(scheduler, system + [2 + i]).seq_id for i in range(4)]
    assert admitted() == waiting[:2]  # 6 + 6 pages fit 13; a third would be 18
    assert all(seq.num_cached_pages == 6 for seq in scheduler.running if seq.seq_id in waiting)
    scheduler.prefix_map_budget = 0
    assert admitted() == waiting[2:3]  # the first is always admitted
    scheduler.prefix_map_budget = None
    assert admitted() == waiting[3:]


def report(pages: int, seconds: float, device: float, rank: int = 0) -> WorkerReport:
    return WorkerReport(0, rank, 0, 0, 0, 0, 0, 0.0, 0.0, 0, (), device, pages, seconds)


def test_the_pacer_divides_the_last_steps_device_time_by_the_seconds_a_page_takes():
    pacer = PrefixMappingPacer()
    pacer.update((report(0, 0.0, 0.0),))
    assert pacer.budget is None  # nothing measured yet
    pacer.update((report(100, 0.010, 0.050),))  # 100 us a page; a 50 ms step
    assert pacer.budget == 500
    pacer.update((report(100, 0.010, 0.070),))  # no mapping: the page cost stands; a 20 ms step
    assert pacer.budget == 200
    pacer.update((report(200, 0.030, 0.090),))  # 200 us a page now: smoothed to 130
    assert pacer.seconds_per_page == 0.3 * 200e-6 + 0.7 * 100e-6
    # two workers: the slowest one's page, the shortest one's step
    pacer = PrefixMappingPacer()
    pacer.update((report(0, 0.0, 0.0), report(0, 0.0, 0.0, rank=1)))
    pacer.update((report(100, 0.010, 0.080), report(100, 0.020, 0.060, rank=1)))
    assert (pacer.seconds_per_page, pacer.step_device_seconds, pacer.budget) == (200e-6, 0.060, 300)
    disabled = PrefixMappingPacer(enabled=False)
    disabled.update((report(0, 0.0, 0.0),))
    disabled.update((report(100, 0.010, 0.050),))
    assert disabled.budget is None


def test_paced_admissions_start_later_and_give_the_same_tokens():
    """On the CPU no device time is reported, so the engine does not pace; a step time set by hand (half a page's
    mapping) makes it: each step then maps one cached prefix, the requests take more steps, and every token is the
    same."""
    rng = random.Random(0)
    systems = [[rng.randint(3, 300) for _ in range(rng.randint(80, 140))] for _ in range(2)]
    prompts = [rng.choice(systems) + [rng.randint(3, 300) for _ in range(rng.randint(1, 20))] for _ in range(16)]
    kw = dict(device="cpu", max_num_seqs=16, max_model_len=256, page_size=4096, kv_memory=8 << 20)
    runs = {}
    for paced in (False, True):
        with LLM("tiny", **kw) as llm:
            for tail in (1, 2):  # the system prompts cached, then found: a page's mapping measured
                llm.generate([system + [tail] for system in systems], GREEDY)
            assert llm.core.pacer.seconds_per_page is not None and llm.core.pacer.budget is None
            if paced:
                llm.core.pacer.step_device_seconds = 0.5 * llm.core.pacer.seconds_per_page  # a budget of 0 pages
            steps = llm.core.num_steps
            runs[paced] = ([list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)],
                           llm.core.num_steps - steps)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > runs[False][1]
