"""The scheduler alone, over its page ledger, with hand-built sampling results (no model). A real
host-memory cache replays the ledger's operations, as a worker does, and must agree with it exactly."""

from __future__ import annotations

import random

import pytest
import torch

from cluster.scheduler import Scheduler, SchedulerConfig
from cluster.sequence import Request, Sequence, SeqStatus
from kvmem import AsyncMapper, KVCacheSpec, PagedKVCache, VirtualKVCache, paged_spec
from kvmem.ledger import PageLedger
from kvmem.ops import AllocSlot, Ensure, apply_ops
from kvmem.swap import SwapSpace
from tests.conftest import check_invariants
from worker.sampling import SamplingParams

SPEC = KVCacheSpec(2, 2, 16, torch.float32, max_slots=4, max_tokens=256, layout="mega", page_size=4096)  # 16 tokens/page


def add(scheduler: Scheduler, prompt: int | list[int], max_tokens: int = 8, n: int = 1) -> Sequence:
    """A request of ``prompt`` (its token ids, or a length: ``3, 4, ...``)."""
    params = SamplingParams(max_tokens=max_tokens, n=n)
    ids = tuple(range(3, 3 + prompt)) if isinstance(prompt, int) else tuple(prompt)
    request = Request(str(len(ids)), None, ids, params, 0)
    seq = Sequence(scheduler.new_seq_id(), request, 0, list(request.prompt_token_ids))
    request.seqs.append(seq)
    scheduler.add(seq)
    return seq


def sample_all(out) -> dict[int, tuple[int, ...]]:
    return {s.seq.seq_id: (7,) * s.num_samples for s in out.scheduled if s.num_samples}


def test_chunked_prefill_and_the_lookahead_plan():
    ledger = PageLedger(SPEC, 64, keeps_pages_on_free=True)
    with VirtualKVCache(SPEC, 64 * 2 * 4096) as cache, AsyncMapper(cache) as mapper:
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), ledger)
        a, b, c = add(scheduler, 40), add(scheduler, 30), add(scheduler, 50)
        out = scheduler.schedule()
        assert [(s.seq, s.num_tokens, s.num_samples) for s in out.scheduled] == [(a, 40, 1), (b, 24, 0)]
        ops = (AllocSlot(a.slot, 48), Ensure(a.slot, 40), AllocSlot(b.slot, 38), Ensure(b.slot, 24))  # prompt + max_tokens
        assert ledger.take_ops() == ops
        apply_ops(cache, ops)
        plan = scheduler.lookahead(out)
        assert plan.needs == {a.slot: 41, b.slot: 30}
        assert not ledger.has_ops  # mapping ahead travels as the plan, not as operations
        mapper.wait(mapper.submit(plan))
        assert (cache.num_tokens(a.slot), cache.num_tokens(b.slot)) == (41, 30)
        scheduler.postprocess(out, sample_all(out))
        maps = cache.stats().maps
        out = scheduler.schedule()
        assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 1), (b, 6), (c, 50)]
        assert ledger.take_ops() == (AllocSlot(c.slot, 58), Ensure(c.slot, 50))  # a's and b's were backed ahead
        apply_ops(cache, (AllocSlot(c.slot, 58), Ensure(c.slot, 50)))
        assert cache.stats().maps == maps + 4  # only c's 4 pages
        assert ledger.accounting() == cache.accounting()


def test_preemption_takes_the_latest_arrival_and_recomputes_it_later():
    ledger = PageLedger(SPEC, 6, keeps_pages_on_free=True)  # 6 pages = 96 tokens
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256), ledger)
    first, second, third = add(scheduler, 30, 40), add(scheduler, 30, 40), add(scheduler, 30, 40)
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled] == [first, second, third]  # 2 pages each: the pool is full
    scheduler.postprocess(out, sample_all(out))
    for _ in range(2):  # tokens 31, 32 fit in the second pages
        scheduler.postprocess(scheduler.schedule(), {s.seq_id: (7,) for s in (first, second, third)})
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


def test_a_short_request_in_a_long_ones_slot_leaves_the_rest_to_others():
    """Deferred reclamation hands a finished request's mapped pages to the next one in its slot; pages past what
    that request can grow to are taken by others when the pool is short, rather than waiting or preempting. The
    workers' cache, replaying the ledger's operations, agrees page for page."""
    ledger = PageLedger(SPEC, 6, keeps_pages_on_free=True)  # 6 pages = 96 tokens
    with VirtualKVCache(SPEC, 6 * 2 * 4096) as cache:
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256), ledger)
        long = add(scheduler, 80, max_tokens=8)  # its prompt takes 5 of the 6 pages
        out = scheduler.schedule()
        scheduler.postprocess(out, sample_all(out))
        scheduler.finish(long, "length")
        short, other = add(scheduler, 10, max_tokens=6), add(scheduler, 60, max_tokens=8)  # 1 and 5 pages at most
        out = scheduler.schedule()
        assert [s.seq for s in out.scheduled] == [short, other] and not out.preempted
        # short reuses long's slot and its 5 pages; `other` took the free page and 3 of short's 4 surplus ones
        assert short.slot == 0 and len(ledger._slots[0].pages) == 2
        apply_ops(cache, ledger.take_ops())
        assert ledger.accounting() == cache.accounting()


def test_a_step_scheduled_while_the_last_one_runs():
    """Async scheduling: step 2 is scheduled before step 1's tokens are back. A sequence whose step-1 token
    is its last is left out; the others feed that token back as a placeholder; a parent preempted while its
    n = 2 first tokens were being drawn still gets them, and its fork waits for a slot of its own."""
    ledger = PageLedger(SPEC, 4, keeps_pages_on_free=True)  # 4 pages of 16 tokens
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256), ledger)
    a, short, parent = add(scheduler, 32), add(scheduler, 8, max_tokens=1), add(scheduler, 16, n=2)
    first = scheduler.schedule()
    assert [(s.seq, s.start, s.num_tokens, s.num_samples) for s in first.scheduled] == [(a, 0, 32, 1), (short, 0, 8, 1),
                                                                                        (parent, 0, 16, 2)]
    assert (a.num_computed, a.pending, a.num_tokens, parent.num_generated) == (32, 1, 33, 1)
    second = scheduler.schedule()  # a's token 33 needs a page: the latest arrival, in flight, goes
    assert [(s.seq, s.start, s.num_tokens, s.num_samples) for s in second.scheduled] == [(a, 32, 1, 1)]
    assert second.preempted == [parent] and (parent.num_computed, parent.slot) == (0, None)
    assert short.status is SeqStatus.RUNNING and not scheduler.ends_in_flight(a) and scheduler.ends_in_flight(short)
    updated = scheduler.postprocess(first, {a.seq_id: (7,), short.seq_id: (6,), parent.seq_id: (8, 9)})
    child = next(s for s in updated if s.request is parent.request and s is not parent)
    assert (parent.token_ids[-1], child.token_ids[-1], child.slot, child.status) == (8, 9, None, SeqStatus.WAITING)
    assert list(scheduler.waiting) == [child, parent] and (a.pending, parent.pending) == (1, 0)
    scheduler.finish(short, "length")
    scheduler.finish(a, "stop")  # a stop token found in step 1's tokens: step 2's token for it is dropped
    assert scheduler.postprocess(second, {a.seq_id: (5,)}) == [] and a.token_ids[-1] == 7
    out = scheduler.schedule()
    assert [(s.seq, s.start, s.num_tokens) for s in out.scheduled][0] == (child, 0, 17)  # computes the prompt anew


def test_three_steps_in_flight_continue_on_the_step_befores_token_and_readmit_only_known_tokens():
    """``async_depth=3``: each step is scheduled while the two before it run. A running sequence takes each step on a
    placeholder for the token the step just before it draws (three pending at most); one preempted while its token was
    drawn two steps back waits until that token is read (the worker fills placeholders only from the step just
    before), then comes back with it known."""
    ledger = PageLedger(SPEC, 4, keeps_pages_on_free=True)  # 4 pages of 16 tokens
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256), ledger)
    a, z, p = add(scheduler, 32, max_tokens=8), add(scheduler, 8), add(scheduler, 15)
    first = scheduler.schedule()  # every page taken
    assert [s.seq for s in first.scheduled] == [a, z, p] and p.pending == 1
    second = scheduler.schedule()  # a's 33rd token needs a page: the latest arrival goes, its token in flight
    assert [(s.seq, s.start, s.num_tokens) for s in second.scheduled] == [(a, 32, 1), (z, 8, 1)]
    assert second.preempted == [p] and (p.status, p.pending, p.num_computed) == (SeqStatus.WAITING, 1, 0)
    scheduler.finish(z, "abort")  # room for p again
    third = scheduler.schedule()
    assert [(s.seq, s.start, s.num_tokens, s.num_samples) for s in third.scheduled] == [(a, 33, 1, 1)]
    assert a.pending == 3 and list(scheduler.waiting) == [p]  # p's token, drawn by `first`, is not known yet
    scheduler.postprocess(first, sample_all(first))
    assert (p.pending, len(p.token_ids)) == (0, 16)
    fourth = scheduler.schedule()
    assert [(s.seq, s.start, s.num_tokens, s.num_samples) for s in fourth.scheduled] == [(a, 34, 1, 1), (p, 0, 16, 1)]
    assert all(s.start + s.num_tokens <= len(s.seq.token_ids) for s in fourth.scheduled if s.seq is p)


def test_micro_batches_take_other_sequences_and_never_one_whose_token_is_in_flight():
    """Pipeline parallelism, two micro-batches: the step scheduled while the first one runs takes other sequences (a
    step at most half of max_num_seqs), never one whose token is still drawn (no placeholder: the first stage never
    sees the last stage's samples); one preempted while its token was drawn comes back only with that token."""
    ledger = PageLedger(SPEC, 6, keeps_pages_on_free=True)  # 6 pages of 16 tokens
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, micro_batches=2), ledger)
    a, b = add(scheduler, list(range(3, 19))), add(scheduler, list(range(4, 20)))  # 16 tokens: a page each
    c, d = add(scheduler, 32), add(scheduler, 31)  # two pages each
    first = scheduler.schedule()
    assert [(s.seq, s.num_tokens, s.num_samples) for s in first.scheduled] == [(a, 16, 1), (b, 16, 1)]
    second = scheduler.schedule()
    assert [(s.seq, s.num_tokens, s.num_samples) for s in second.scheduled] == [(c, 32, 1), (d, 31, 1)]
    assert scheduler.schedule().scheduled == []  # every sequence waits for its token
    scheduler.postprocess(first, sample_all(first))
    third = scheduler.schedule()  # a's and b's 17th tokens need a page each: d, in flight, is preempted
    assert [(s.seq, s.start, s.num_tokens) for s in third.scheduled] == [(a, 16, 1), (b, 16, 1)]
    assert third.preempted == [d] and (d.status, d.pending, d.slot) == (SeqStatus.WAITING, 1, None)
    assert all(s.start + s.num_tokens <= len(s.seq.token_ids) for s in third.scheduled)  # every token known
    scheduler.finish(c, "abort")  # room for d, but its token is still being drawn
    assert scheduler.schedule().scheduled == []
    assert scheduler.postprocess(second, sample_all(second)) == [d] and len(d.token_ids) == 32
    assert [(s.seq, s.start, s.num_tokens, s.num_samples) for s in scheduler.schedule().scheduled] == [(d, 0, 32, 1)]


def test_in_a_token_ring_a_sequence_comes_round_on_a_placeholder_as_many_steps_later_as_there_are_stages():
    """Two stages whose last hands its drawn tokens back to the first: a micro-batch's sequences take a step again
    two steps after their last, on placeholders, before their tokens are read; never the step right after (the last
    stage has not drawn them when the first computes it), nor with two tokens in flight."""
    ledger = PageLedger(SPEC, 16, keeps_pages_on_free=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, micro_batches=2, token_ring=2),
                          ledger)
    a, b, c, d = (add(scheduler, list(range(3 + i, 13 + i))) for i in range(4))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert [s.seq for s in first.scheduled] == [a, b] and [s.seq for s in second.scheduled] == [c, d]
    third = scheduler.schedule()  # nothing read yet: a and b come round on their tokens in flight
    assert [(s.seq, s.start, s.num_tokens, s.num_samples) for s in third.scheduled] == [(a, 10, 1, 1), (b, 10, 1, 1)]
    assert (a.pending, b.pending) == (2, 2)
    fourth = scheduler.schedule()  # c and d now; a and b have two tokens in flight and were in the step before
    assert [s.seq for s in fourth.scheduled] == [c, d]
    assert scheduler.schedule().scheduled == []  # every sequence's last step is one of the last two, or two pending
    scheduler.postprocess(first, sample_all(first))
    assert [s.seq for s in scheduler.schedule().scheduled] == [a, b]  # one token in flight again, two steps on


def test_mapping_ahead_never_copies_a_shared_page():
    """A parent whose next token lands in the page it shares with its fork is left out of the plan: the
    copy would run on the mapper thread while this step writes that page. The next step's ensure copies."""
    ledger = PageLedger(SPEC, 64, keeps_pages_on_free=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), ledger)
    parent, long = add(scheduler, 20, n=2), add(scheduler, 200)
    out = scheduler.schedule()
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(parent, 20), (long, 44)]
    scheduler.lookahead(out)
    (child,) = [s for s in scheduler.postprocess(out, sample_all(out)) if s is not parent]
    ledger.take_ops()
    out = scheduler.schedule()  # the long prefill takes the budget the fork would have had
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(parent, 1), (long, 63)]
    shared = ledger.accounting().shared_pages
    plan = scheduler.lookahead(out)
    assert parent.slot not in plan.needs and long.slot in plan.needs
    assert ledger.accounting().shared_pages == shared  # no page was copied ahead
    scheduler.postprocess(out, sample_all(out))
    ledger.take_ops()
    out = scheduler.schedule()
    assert Ensure(parent.slot, 22) in ledger.take_ops()  # the copy-on-write, replayed before the step's writes
    assert ledger.accounting().shared_pages == shared - 1
    assert child.status is SeqStatus.RUNNING


def _worker_cache(layout: str, pages: int):
    if layout == "paged":
        spec = paged_spec(2, 2, 16, dtype=torch.float32, max_slots=4, max_tokens=256)
        return spec, PagedKVCache(spec, pages * spec.page_size * spec.bytes_per_token)
    return SPEC, VirtualKVCache(SPEC, pages * 2 * 4096)


@pytest.mark.parametrize(("layout", "mode", "caching", "fused"),
                         [(layout, mode, caching, 0) for layout in ("mega", "paged") for mode in ("recompute", "swap")
                          for caching in (False, True)] + [("mega", mode, True, 2) for mode in ("recompute", "swap")])
def test_a_cache_replaying_the_ledger_agrees_with_it_after_every_step(layout, mode, caching, fused):
    """Random arrivals (prompts over a few shared prefixes), n > 1 forks over shared pages, aborts and preemption
    under a tight pool, with and without prefix caching (and with cached prefixes fused on their first reuse): after
    every step the replaying cache holds the same slots, tokens, page counts, free pages and held blocks as the
    ledger; at the end every page it holds is reachable (a free slot's or a held block's), and dropping the cached
    prefixes gives the whole pool back."""
    rng = random.Random(0)
    spec, cache = _worker_cache(layout, 12)
    ledger = PageLedger(spec, 12, keeps_pages_on_free=layout != "paged", caches_prefixes=caching)
    swap = SwapSpace(cache)
    scheduler = Scheduler(SchedulerConfig(4, 48, mode, 1 << 20, fused_prefix_pages=fused), ledger)
    shortest, longest = (32, 48) if fused else (0, 40)  # fusing: prefixes of two pages or more
    prefixes = [[rng.randint(0, 99) for _ in range(rng.randint(shortest, longest))] for _ in range(4)]
    added = 0
    with cache, AsyncMapper(cache) as mapper:
        while added < 500 or scheduler.has_work:
            if added < 500 and rng.random() < 0.4:
                prompt = rng.choice(prefixes) + [rng.randint(0, 99) for _ in range(rng.randint(1, 20))]
                add(scheduler, prompt, rng.randint(1, 30), n=rng.choice([1, 1, 2]))
                added += 1
            if scheduler.running and rng.random() < 0.05:
                scheduler.finish(rng.choice(scheduler.running), "abort")
            out = scheduler.schedule()
            ahead = scheduler.lookahead(out)  # as the engine: the pages evicted for it go with the step's operations
            apply_ops(cache, ledger.take_ops(), swap)
            plan = mapper.submit(ahead)
            mapper.wait(plan)  # the plan always fits the replaying cache's pool
            for seq in scheduler.postprocess(out, sample_all(out)):
                if seq.num_output_tokens >= seq.request.params.max_tokens:
                    scheduler.finish(seq, "length")
            apply_ops(cache, ledger.take_ops(), swap)
            assert ledger.accounting() == cache.accounting()
        assert scheduler.num_preemptions > 0 and (scheduler.prefix_hits > 0) == caching
        assert (ledger.prefix_runs_fused > 0) == bool(fused)
        assert cache.stats().slots_in_use == 0 and swap.used_bytes == 0 and scheduler.swap_used_bytes == 0
        check_invariants(cache)  # every page it holds is a free slot's or a held block's, and counted so
        assert cache.kept_pages() == (len(ledger.prefixes) if caching else 0)  # each held page can be found
        ledger.reset_prefixes()
        apply_ops(cache, ledger.take_ops(), swap)
        assert ledger.accounting() == cache.accounting()
        cache.reclaim(10**6)
        assert cache.stats().mapped_bytes == 0 and not cache._runs
