"""The scheduler alone, over a real host-memory cache, with hand-built sampling results (no model)."""

from __future__ import annotations

import torch

from cluster.scheduler import Scheduler, SchedulerConfig
from cluster.sequence import Request, Sequence, SeqStatus
from kvmem import AsyncMapper, KVCacheSpec, VirtualKVCache
from worker.sampling import SampledToken, SamplingParams

SPEC = KVCacheSpec(2, 2, 16, torch.float32, max_slots=4, max_tokens=256, layout="mega", page_size=4096)  # 16 tokens/page


def add(scheduler: Scheduler, prompt_len: int, max_tokens: int = 8) -> Sequence:
    request = Request(str(prompt_len), None, tuple(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens), 0)
    seq = Sequence(scheduler.new_seq_id(), request, 0, list(request.prompt_token_ids))
    request.seqs.append(seq)
    scheduler.add(seq)
    return seq


def sample_all(out) -> dict[int, tuple[SampledToken, ...]]:
    return {s.seq.seq_id: (SampledToken(7),) * s.num_samples for s in out.scheduled if s.num_samples}


def test_chunked_prefill_and_the_lookahead_plan():
    with VirtualKVCache(SPEC, 64 * 2 * 4096) as cache, AsyncMapper(cache) as mapper:
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), cache)
        a, b, c = add(scheduler, 40), add(scheduler, 30), add(scheduler, 50)
        out = scheduler.schedule()
        assert [(s.seq, s.num_tokens, s.num_samples) for s in out.scheduled] == [(a, 40, 1), (b, 24, 0)]
        plan = scheduler.lookahead(out)
        assert plan.needs == {a.slot: 41, b.slot: 30}
        mapper.wait(mapper.submit(plan))
        assert (cache.num_tokens(a.slot), cache.num_tokens(b.slot)) == (41, 30)
        scheduler.postprocess(out, sample_all(out))
        maps = cache.stats().maps
        out = scheduler.schedule()
        assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 1), (b, 6), (c, 50)]
        assert cache.stats().maps == maps + 4  # only c's 4 pages: a's and b's were mapped ahead


def test_preemption_takes_the_latest_arrival_and_recomputes_it_later():
    pool = 6 * 2 * 4096  # 6 page groups = 96 tokens
    with VirtualKVCache(SPEC, pool) as cache:
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256), cache)
        first, second, third = add(scheduler, 30, 40), add(scheduler, 30, 40), add(scheduler, 30, 40)
        out = scheduler.schedule()
        assert [s.seq for s in out.scheduled] == [first, second, third]  # 2 pages each: the pool is full
        scheduler.postprocess(out, sample_all(out))
        for _ in range(2):  # tokens 31, 32 fit in the second pages
            scheduler.postprocess(scheduler.schedule(), {s.seq_id: (SampledToken(7),) for s in (first, second, third)})
        out = scheduler.schedule()  # token 33 needs a third page each: the latest arrival goes
        assert out.preempted == [third] and third.status is SeqStatus.WAITING
        assert [s.seq for s in out.scheduled] == [first, second]  # third's two pages were enough for both
        assert (third.num_computed, third.num_preemptions, scheduler.num_preemptions) == (0, 1, 1)
        assert list(scheduler.waiting) == [third]
        scheduler.postprocess(out, sample_all(out))
        scheduler.finish(first, "length")
        scheduler.finish(second, "length")
        out = scheduler.schedule()  # recompute: prompt and the three tokens it had sampled, in one chunk
        assert [(s.seq, s.num_tokens, s.num_samples) for s in out.scheduled] == [(third, 33, 1)]
