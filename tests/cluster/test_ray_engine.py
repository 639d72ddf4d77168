"""The Ray engine on CPU, real Ray: a scheduler actor over TP / PP worker actors gives the tokens of the
in-process engine (and of transformers), keeps every worker's page accounting equal to its ledger, survives
a killed worker, refuses impossible shapes before anything starts, and leaves nothing behind."""

from __future__ import annotations

import gc
import random
import re
import time

import pytest

ray = pytest.importorskip("ray")

from cluster.config import EngineConfig, model_config, plan  # noqa: E402
from cluster.engine import LLM  # noqa: E402
from cluster.errors import EngineDeadError, EngineDrainingError  # noqa: E402
from cluster.ray_executor import RayExecutor  # noqa: E402
from cluster.scheduler_actor import AddCall  # noqa: E402
from tests.cluster.conftest import NEW_TOKENS, step_ranges  # noqa: E402
from worker.sampling import SamplingParams, StructuredOutputs  # noqa: E402

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SHAPES = [(2, 1), (1, 2), (2, 2)]  # (tp, pp)
SMALL = dict(device="cpu", max_num_seqs=8, max_model_len=128, page_size=4096, block_size=16)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def vattn_actors() -> list[str]:
    return [n for n in ray.util.list_named_actors() if n.startswith("vattn-")]


def live_placement_groups() -> list[str]:
    return [pg["name"] for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def released(timeout: float = 10.0) -> bool:
    """Whether every vattn actor and placement group is gone within ``timeout`` s: ``ray.kill`` returns before the
    cluster has marked the actor dead (under CI's load a killed worker's name was still listed right after close)."""
    deadline = time.monotonic() + timeout
    while vattn_actors() or live_placement_groups():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def assert_in_step(llm: LLM) -> None:
    """Every worker's slots, tokens, page counts and free pages equal the scheduler ledger's."""
    *workers, ledger = llm._engine.worker_accounting()
    assert all(w == ledger for w in workers)


def demand(path: str, layout: str, tp: int, pp: int, prompts) -> int:
    """Bytes one worker needs to hold every prompt and its output at once."""
    config = EngineConfig(path, kv_layout=layout, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          distributed="ray", **SMALL)
    spec = plan(config, model_config(path), "cpu").ledger_spec
    return sum(spec.physical_bytes_for(len(p) + NEW_TOKENS) for p in prompts)


def test_a_consumers_poll_sees_requests_added_while_it_waits_and_no_one_elses():
    """The HTTP ingress polls the outputs of its own requests by consumer name. One added while that poll already
    waits is seen at its first token, not after the poll's timeout; another consumer's never is. The prompt's
    token ids come with the final output only."""
    forty = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM("tiny", distributed="ray", kv_memory=8 << 20, **SMALL) as llm:
        actor = llm._engine.actor
        waiting = actor.wait_outputs.remote(None, 30.0, "ingress-a")
        time.sleep(0.5)  # the poll waits, its consumer has no request yet
        start = time.monotonic()
        ray.get(actor.add_requests.remote(["theirs"], [forty], True, ["b1"], "ingress-b"))
        ray.get(actor.add_requests.remote(["mine"], [forty], True, ["a1"], "ingress-a"))
        seen = ray.get(waiting, timeout=30)
        assert [o.request_id for o in seen] == ["a1"] and time.monotonic() - start < 10
        deadline = time.monotonic() + 60
        while sum(o.finished for o in seen) < 2 and time.monotonic() < deadline:
            for consumer in ("ingress-a", "ingress-b"):
                seen += ray.get(actor.wait_outputs.remote(None, 5.0, consumer))
        finals = {o.request_id: o for o in seen if o.finished}
        assert sorted(finals) == ["a1", "b1"] and all(len(o.outputs[0].token_ids) == 40 for o in finals.values())
        assert finals["a1"].prompt_token_ids == tuple(b"mine") and finals["b1"].prompt_token_ids == tuple(b"theirs")
        assert finals["a1"].prompt == "mine"
        running = [o for o in seen if not o.finished]
        assert running and all(o.prompt_token_ids == () and o.prompt is None for o in running)


def test_a_poll_counts_the_step_outputs_of_a_stream_it_took_at_once():
    """``vattn:stream_outputs_per_poll``: 1 where the polls keep up with the steps; a stream left unpolled for a while
    is taken with every step's output since (its tokens reach the client that many steps at a time). A non-streamed
    request's final output is not counted."""
    many = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM("tiny", distributed="ray", kv_memory=8 << 20, **SMALL) as llm:
        actor = llm._engine.actor
        ray.get(actor.add_requests.remote(["kept up"], [many], True, ["s"], "ingress"))
        ray.get(actor.add_requests.remote(["whole"], [many], False, ["w"], "ingress"))
        steps, taken = [], {}
        while "s" not in taken:  # one step output at a time: the poll is back before the next step ends
            for o in ray.get(actor.wait_outputs.remote(["s"], 10.0)):
                steps.append(len(o.outputs[0].token_ids))
                if o.finished:
                    taken["s"] = o
        ray.get(actor.add_requests.remote(["late"], [many], True, ["l"], "ingress"))
        # ... and one polled only once it has ended (counted as finished: just added, it may not be running yet)
        while sum(llm.snapshot().finished.values()) < 3:
            time.sleep(0.05)
        (late,) = ray.get(actor.wait_outputs.remote(["l"], 10.0))
        ray.get(actor.wait_outputs.remote(["w"], 10.0))
        polls = llm.snapshot().histograms["stream_outputs_per_poll"]
        assert late.finished and len(late.outputs[0].token_ids) == 60
        assert polls.count == len(steps) + 1  # the streams' polls; not the whole request's
        assert polls.total == 2 * 60  # every step output of both streams counted once, whatever the polls' cadence
        assert polls.counts[-1] == 1  # the late stream's one poll took all 60 at once (past the last bound, 32)


def test_a_draining_scheduler_finishes_what_it_holds_and_refuses_new_calls():
    """Calls (``AddCall``, what the HTTP ingress sends: text or token ids, salted or not) queue their requests. Once
    the replica drains (a rolling update), the scheduler refuses new calls with ``EngineDrainingError`` -- the ingress
    sends them to Serve instead -- and runs the requests it holds to their ends. Calls that come together
    (``add_many``) each get their own answer: a bad one's error in its place, the others queued."""
    forty = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM("tiny", distributed="ray", kv_memory=8 << 20, **SMALL) as llm:
        actor = llm._engine.actor
        ray.get(actor.add.remote(AddCall(["held"], forty, True, ("h1",), "ingress-a")))
        errors = ray.get(actor.add_many.remote([
            AddCall([[104, 105]], forty, False, ("c1",), "ingress-a", cache_salt="tenant"),
            AddCall([[104, 1 << 20]], forty, False, ("x1",), "ingress-a")]))
        assert errors[0] is None and isinstance(errors[1], ValueError) and "prompt token ids" in str(errors[1])
        ray.get(actor.drain.remote())
        assert ray.get(actor.health.remote()) == "draining"
        with pytest.raises(EngineDrainingError, match="being stopped: it takes no new requests"):
            ray.get(actor.add.remote(AddCall(["late"], forty, True, ("l1",), "ingress-a")))
        [late] = ray.get(actor.add_many.remote([AddCall(["late"], forty, True, ("l2",), "ingress-a")]))
        assert isinstance(late, EngineDrainingError)
        finals, deadline = {}, time.monotonic() + 60
        while len(finals) < 2 and time.monotonic() < deadline:
            finals |= {o.request_id: o for o in ray.get(actor.wait_outputs.remote(None, 5.0, "ingress-a")) if o.finished}
        assert sorted(finals) == ["c1", "h1"] and all(len(o.outputs[0].token_ids) == 40 for o in finals.values())
        assert finals["c1"].prompt_token_ids == (104, 105) and finals["h1"].prompt == "held"
        assert ray.get(actor.in_flight.remote()) == 0


@pytest.mark.parametrize("layout", ["mega", "per_layer", "paged"])
@pytest.mark.parametrize(("tp", "pp"), SHAPES)
def test_chunked_and_oversubscribed_tp_pp_match_transformers(hf_llama, tp, pp, layout):
    path, prompts, expected = hf_llama
    kv = demand(path, layout, tp, pp, prompts) // 4  # 4x oversubscribed: preemption by recompute
    with LLM(path, distributed="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_layout=layout,
             kv_memory=kv, max_num_batched_tokens=7, dtype="float32", **SMALL) as llm:
        outputs = llm.generate(prompts, GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        snap = llm.snapshot()
        assert snap.num_preemptions > 0
        assert [(w.pp_rank, w.tp_rank) for w in snap.workers] == [(p, t) for p in range(pp) for t in range(tp)]
        assert all(w.slots_in_use == 0 and w.used_bytes == 0 for w in snap.workers)
        assert_in_step(llm)


@pytest.mark.parametrize(("tp", "pp", "fused"), [(2, 1, 0), (1, 2, 0), (2, 1, 2)])
def test_prefix_caching_across_tp_and_pp_gives_the_tokens_of_an_engine_without_it(tp, pp, fused):
    """Every worker holds, maps and evicts the blocks the ledger decides, under memory pressure (and fuses the
    prefixes it decides to): the tokens are those computed without caching, and every worker's accounting (held blocks
    included) equals the ledger's."""
    rng = random.Random(2)
    systems = [[rng.randrange(3, 250) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(3, 250) for _ in range(rng.randint(1, 20))] for _ in range(16)]
    # Fusing: room for the prefix's requests to run side by side (in a tighter pool each reuses a slot holding it)
    kw = dict(SMALL, kv_memory=(256 if fused else 160) << 10, max_num_batched_tokens=48)
    with LLM("tiny", enable_prefix_caching=False, **kw) as local:
        want = [list(o.outputs[0].token_ids) for o in local.generate(prompts, GREEDY)]
    with LLM("tiny", distributed="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp, fused_prefix_pages=fused,
             **kw) as llm:
        for _ in range(2):  # the second pass finds the first one's blocks (those not evicted)
            assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)] == want
        snap = llm.snapshot()
        assert snap.prefix_cache_hits > 0 and snap.num_preemptions > 0 and (snap.prefix_runs_fused > 0) == bool(fused)
        assert all(w.prefix_cache_bytes > 0 for w in snap.workers)
        assert_in_step(llm)
        assert llm.reset_prefix_cache() > 0
        assert_in_step(llm)
        assert all(w.kept_pages == 0 for w in llm._engine.worker_accounting())


def test_pipeline_stages_compute_micro_batches_of_other_sequences_at_once():
    """PP=2 keeps a micro-batch a stage in flight (stage 0 computes one while stage 1 computes the other, over disjoint
    sequences): the in-process engine's tokens, steps sent while another was in flight, under preemption, every worker's
    accounting equal to the ledger's at the end: with the last stage handing its tokens back to the first (a token
    ring, the default: a micro-batch's next step sent before its tokens are read), at TP=2 too; with three
    micro-batches in flight (``pipeline_micro_batches``, through the compiled graph's channel); with the stages
    handing hidden states on themselves without the ring (``pipeline_handoff="p2p"``), at TP=2 too; through the
    channel with a micro-batch a stage; one step at a time with ``async_scheduling=False``."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(5, 60))] for _ in range(16)]
    params = [SamplingParams(max_tokens=rng.randint(4, 24), temperature=0, ignore_eos=True) for _ in prompts]
    kw = dict(SMALL, dtype="float32", max_num_batched_tokens=40, kv_memory=96 << 10)
    with LLM("tiny", **kw) as local:
        want = [list(o.outputs[0].token_ids) for o in local.generate(prompts, params)]
    for options in (dict(), dict(tensor_parallel_size=2), dict(pipeline_micro_batches=3), dict(pipeline_handoff="p2p"),
                    dict(pipeline_handoff="p2p", tensor_parallel_size=2, pipeline_micro_batches=3),
                    dict(pipeline_handoff="channel"), dict(async_scheduling=False)):
        with LLM("tiny", distributed="ray", pipeline_parallel_size=2, **options, **kw) as llm:
            assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)] == want
            snap = llm.snapshot()
            assert snap.num_preemptions > 0
            ahead = "async_scheduling" not in options
            assert (snap.num_overlapped_steps > snap.num_steps // 3) if ahead else snap.num_overlapped_steps == 0
            assert all(w.slots_in_use == 0 and w.used_bytes == 0 for w in snap.workers)
            assert_in_step(llm)


@pytest.mark.parametrize("depth", [None, 2])
def test_steps_in_flight_at_tp2_give_the_in_process_engines_tokens(depth):
    """Three steps in flight over Ray at TP=2 (``async_depth``'s default there): each call queues a step while the two
    before it are in flight and returns the tokens of the oldest; under preemption, n > 1 forks and stops found two
    steps late the tokens are the in-process engine's (one step at a time), and every worker ends at zero. The same
    with two steps in flight."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(5, 60))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(4, 24), temperature=0, ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(max_tokens=16, temperature=1.0, n=2, seed=4, ignore_eos=True)
    kw = dict(SMALL, dtype="float32", max_num_batched_tokens=40, kv_memory=96 << 10)
    with LLM("tiny", async_scheduling=False, **kw) as local:
        want = [[list(c.token_ids) for c in o.outputs] for o in local.generate(prompts, params)]
        stop = want[0][0][2]
    params[0] = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    want[0][0] = want[0][0][: want[0][0].index(stop) + 1]
    with LLM("tiny", distributed="ray", tensor_parallel_size=2, async_depth=depth, **kw) as llm:
        assert llm.plan.steps_in_flight == (depth or 3)
        assert [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params)] == want
        snap = llm.snapshot()
        assert snap.num_preemptions > 0 and snap.num_overlapped_steps > snap.num_steps // 2
        assert all(w.slots_in_use == 0 and w.used_bytes == 0 for w in snap.workers)
        assert_in_step(llm)


def test_the_engines_processes_freeze_their_start_up_heaps():
    """The scheduler actor and every worker actor put what they built at start-up out of the garbage collector's
    sight (``worker.heap``): a full collection there would hold a step (or both TP ranks at once) for ~0.2 s."""
    with LLM("tiny", distributed="ray", tensor_parallel_size=2, kv_memory=8 << 20, **SMALL) as llm:
        counts = ray.get(llm._engine.actor.__ray_call__.remote(lambda actor: (gc.get_freeze_count(), ray.get(
            [w.__ray_call__.remote(lambda _: gc.get_freeze_count()) for w in actor.core.executor._actors]))))
    scheduler, workers = counts
    assert scheduler > 10_000 and len(workers) == 2 and all(w > 10_000 for w in workers), counts


def test_a_kv_memory_fraction_sizes_every_pool_once_the_weights_are_in(hf_llama):
    import psutil

    path, prompts, expected = hf_llama
    kv = demand(path, "mega", 2, 2, prompts) // 2
    # On CPU the four workers split the host's available memory: this fraction gives each about ``kv``.
    fraction = kv * 4 / psutil.virtual_memory().available
    with LLM(path, distributed="ray", tensor_parallel_size=2, pipeline_parallel_size=2, kv_memory_fraction=fraction,
             dtype="float32", **SMALL) as llm:
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)] == expected
        snap = llm.snapshot()
        assert snap.num_preemptions > 0  # the sized pools hold about half of what the prompts need at once
        assert len({w.total_pages for w in snap.workers}) == 1  # the tightest worker's count, on every worker
        assert all(abs(w.pool_bytes - kv) <= 0.3 * kv for w in snap.workers)  # (the host's memory moves a little)
        assert_in_step(llm)
    # All of the memory: the pools stop at every slot full (8 slots of 128 tokens), not at the host's gigabytes.
    with LLM("tiny", distributed="ray", pipeline_parallel_size=2, kv_memory_fraction=1.0, **SMALL) as llm:
        spec = plan(EngineConfig("tiny", pipeline_parallel_size=2, distributed="ray", **SMALL), model_config("tiny"), "cpu").ledger_spec
        assert {w.total_pages for w in llm.snapshot().workers} == {8 * spec.pages_for(128)}


def test_a_kv_memory_fraction_too_small_for_one_page_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"kv_memory_fraction=1e-12 leaves 0 bytes of KV memory on the tightest worker: "
                                         r"no KV page of \d+ bytes fits"):
        LLM("tiny", distributed="ray", tensor_parallel_size=2, kv_memory_fraction=1e-12, **SMALL)
    assert released(), (vattn_actors(), live_placement_groups())


def test_cpu_pools_that_fit_the_free_memory_each_but_not_together_are_refused():
    # Two CPU workers on one host, each pool two thirds of what the host has free: each alone fits. Made at once, both
    # workers' checks passed and Ray's memory monitor killed them; now the node's sum is refused before any is made.
    import psutil

    pool = 2 * psutil.virtual_memory().available // 3
    with pytest.raises(ValueError, match=r"kv_memory: the KV pools of 2 workers on one node, .* GiB together, are more "
                                         r"than its cpu memory has free \(.* GiB\): lower kv_memory, or size the pools "
                                         r"with kv_memory_fraction"):
        LLM("tiny", distributed="ray", tensor_parallel_size=2, **(SMALL | {"kv_memory": pool}))
    assert released(), (vattn_actors(), live_placement_groups())


@pytest.mark.parametrize("layout", ["mega", "per_layer", "paged"])
def test_preemption_by_swap_across_tp_and_pp(hf_llama, layout):
    path, prompts, expected = hf_llama
    kv = demand(path, layout, 2, 2, prompts) // 4
    # tp_overlap_rows: prefill products of 4 rows or more in halves, each half's sum overlapping the next product
    with LLM(path, distributed="ray", tensor_parallel_size=2, pipeline_parallel_size=2, kv_layout=layout,
             kv_memory=kv, preemption_mode="swap", dtype="float32", tp_overlap_rows=4, **SMALL) as llm:
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)] == expected
        snap = llm.snapshot()
        assert snap.num_preemptions > 0 and all(w.swap_bytes == 0 for w in snap.workers)
        assert_in_step(llm)


def test_parallel_and_seeded_sampling_equal_the_in_process_engine():
    prompts = ["hello there", "a b c d e f", "xyz" * 9]
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=40, seed=s, n=n, ignore_eos=True,
                             logprobs=2, prompt_logprobs=1) for s, n in ((1, 3), (2, 1), (3, 2))]
    kw = dict(kv_memory=16 << 20, **{**SMALL, "max_model_len": 256})
    with LLM("tiny", **kw) as local:
        want = local.generate(prompts, params)
    with LLM("tiny", distributed="ray", tensor_parallel_size=2, pipeline_parallel_size=2, **kw) as llm:
        got = llm.generate(prompts, params)
        streamed = [o for o in llm.stream(prompts[0], params[0])]
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for cw, cg in zip(w.outputs, g.outputs):
            assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(cw.logprobs, cg.logprobs))
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(g.prompt_token_ids)  # from the sampling worker
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]))
    assert streamed[-1].finished and [c.token_ids for c in streamed[-1].outputs] == [c.token_ids for c in want[0].outputs]
    assert len(streamed) > 1  # it streamed


def test_a_profile_gives_a_trace_per_worker_with_the_same_steps_on_every_tp_rank(tmp_path):
    with LLM("tiny", distributed="ray", tensor_parallel_size=2, kv_memory=8 << 20, **SMALL) as llm:
        llm.start_profile(tmp_path)
        llm.generate([[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        traces = llm.stop_profile()
        with pytest.raises(RuntimeError, match="not recording"):
            llm.stop_profile()
    assert traces == [str(tmp_path / f"vattn_pp0_tp{r}.pt.trace.json.gz") for r in (0, 1)]
    ranks = [[s for s in step_ranges(t) if not s.endswith("_seqs(0)")] for t in traces]
    assert ranks[0] == ranks[1] == ["vattn_step_prefill(8)_decode(0)_seqs(2)"] + ["vattn_step_prefill(0)_decode(2)_seqs(2)"] * 2


def test_grammar_masks_ride_on_the_next_call_and_a_constrained_request_samples_every_step():
    """Workers that launch ahead get a step's grammar masks with the next call and draw it before launching that
    one: a constrained request beside a free one takes about as many steps as the free one's 62, not twice as many,
    across TP ranks of which one samples, and its tokens are the in-process engine's."""
    constrained = SamplingParams(max_tokens=200, temperature=1.0, seed=5, structured_outputs=StructuredOutputs(regex="[ab]{60}"))
    free = SamplingParams(max_tokens=62, temperature=1.0, seed=3, ignore_eos=True)
    kw = dict(kv_memory=16 << 20, **{**SMALL, "max_model_len": 256})
    with LLM("tiny", **kw) as local:
        want = local.generate(["go", "on"], [constrained, free])
    with LLM("tiny", distributed="ray", tensor_parallel_size=2, **kw) as llm:
        before = llm.snapshot().num_steps
        got = llm.generate(["go", "on"], [constrained, free])
        steps = llm.snapshot().num_steps - before
        assert_in_step(llm)
    assert re.fullmatch("[ab]{60}", got[0].outputs[0].text) and got[0].outputs[0].finish_reason == "stop"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert steps <= 66


def test_two_hundred_requests_with_aborts_leave_every_worker_at_zero():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 90))] for _ in range(200)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True) for _ in prompts]
    # 12 slots, and pages for ~3 of the longest requests: admission waits, decode preempts.
    with LLM("tiny", distributed="ray", tensor_parallel_size=2, pipeline_parallel_size=2, kv_memory=96 << 10,
             max_num_seqs=12, max_num_batched_tokens=64, device="cpu", max_model_len=128, page_size=4096) as llm:
        finished, aborted = {}, set()
        for o in llm.stream(prompts, params):
            if o.finished:
                finished[o.request_id] = o
            elif int(o.request_id) % 7 == 0 and o.request_id not in aborted:
                llm.abort(o.request_id)  # mid-flight, with pages in use
                aborted.add(o.request_id)
        cut = {r for r, o in finished.items() if o.outputs[0].finish_reason == "abort"}
        assert len(finished) == 200 and cut <= aborted and len(cut) > 5  # an abort may arrive after the last token
        assert all(len(o.outputs[0].token_ids) == params[int(r)].max_tokens for r, o in finished.items() if r not in cut)
        snap = llm.snapshot()
        assert snap.num_preemptions > 0 and not snap.requests
        assert all(w.slots_in_use == 0 for w in snap.workers)
        assert_in_step(llm)


def run_until_a_fault(llm: LLM, inject) -> tuple[list[str], dict, list[str]]:
    """Two long requests running, two short ones waiting for their slots; ``inject(old actor names)`` after
    20 steps. Returns the ids, every final output, and the old worker actors' names."""
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = [llm.add_request(p, long) for p in ("running a", "running b")]
    ids += [llm.add_request(p, short) for p in ("c", "d")]  # waiting: both slots are taken
    pending, outputs = set(ids), {}
    while llm.snapshot().num_steps < 20:
        time.sleep(0.05)
    old = vattn_actors()
    inject(old)
    while pending:
        for o in llm._engine.poll(pending, True):
            if o.finished:
                outputs[o.request_id] = o
                pending.discard(o.request_id)
    return ids, outputs, old


FAULTS = {
    # The process of TP rank 1 dies.
    "killed": lambda old: ray.kill(ray.get_actor(next(n for n in old if n.endswith("-pp0-tp1")))),
    # TP rank 1 builds its shard afresh (a cache that knows none of the running slots): its next step raises
    # before the layers, and rank 0 must not be left waiting for it in an all-reduce.
    "out of step": lambda old: ray.get(ray.get_actor(next(n for n in old if n.endswith("-pp0-tp1"))).setup.remote(
        None, 1, 2, [[0, 1]])),
}


@pytest.mark.parametrize(("fault", "error"), [
    ("killed", r"ActorDiedError: The actor died unexpectedly before finishing this task\. name: vattn-worker-"),
    # Ray reports one rank's error: rank 0's (stopped with its peer) or rank 1's own.
    ("out of step", r"PeerFailed: TP rank 1 of stage 0 failed step \d+|ValueError: slot \d+ is not in use"),
])
def test_a_failed_worker_fails_requests_in_flight_and_the_group_is_rebuilt(fault, error):
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM("tiny", distributed="ray", tensor_parallel_size=2, max_num_seqs=2, kv_memory=8 << 20, device="cpu",
             max_model_len=512, page_size=4096) as llm:
        want = llm.generate(["c", "d"], short)
        start = time.monotonic()
        ids, outputs, old = run_until_a_fault(llm, FAULTS[fault])
        assert time.monotonic() - start < 60  # no rank hung in a collective until a timeout
        for i in ids[:2]:
            assert outputs[i].outputs[0].finish_reason == "error"
            assert "the worker group failed and was rebuilt" in outputs[i].error, outputs[i].error
            assert re.search(error, outputs[i].error), outputs[i].error
        assert [outputs[i].outputs[0].token_ids for i in ids[2:]] == [w.outputs[0].token_ids for w in want]
        assert llm.generate("after", short)[0].outputs[0].finish_reason == "length"
        assert llm.snapshot().num_rebuilds == 1
        assert not set(vattn_actors()) & set(old)  # the whole group was replaced
        assert len(live_placement_groups()) == 1
        assert_in_step(llm)
    assert released(), (vattn_actors(), live_placement_groups())


def test_a_failure_that_only_says_a_channel_closed_names_the_worker_that_died():
    """A killed worker's step fails either as its death or, when the driver's write notices first, as a closed
    channel; either way the error names the dead actor."""
    config = EngineConfig("tiny", distributed="ray", tensor_parallel_size=2, kv_memory=8 << 20, **SMALL)
    executor = RayExecutor(plan(config, model_config("tiny"), "cpu"))
    try:
        victim = next(n for n in vattn_actors() if n.endswith("-tp1"))
        ray.kill(ray.get_actor(victim))
        error = executor.failure("step 7 could not be sent", ray.exceptions.RayChannelError("Channel closed."))
        assert str(error) == ("step 7 could not be sent: ActorDiedError: The actor died unexpectedly before "
                              f"finishing this task. name: {victim}")
    finally:
        executor.close()
    assert released(), (vattn_actors(), live_placement_groups())


@pytest.mark.parametrize("others", [0, 1])
def test_an_abort_beside_a_dead_worker_leaves_the_step_loop_serving(others):
    """The abort's memory goes back through the dead group: alone, its flush fails; beside another running
    request, the next step fails (or the abort lands after it). Either way every request ends, the loop
    rebuilds the group, and the next request succeeds."""
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    with LLM("tiny", distributed="ray", pipeline_parallel_size=2, max_num_seqs=2, kv_memory=8 << 20, device="cpu",
             max_model_len=512, page_size=4096) as llm:
        want = llm.generate("after", short)[0].outputs[0].token_ids
        request, *rest = [llm.add_request(p, long) for p in ("long", "other")[: 1 + others]]
        while llm.snapshot().num_steps < 10:
            time.sleep(0.02)
        ray.kill(ray.get_actor(next(n for n in vattn_actors() if n.endswith("-pp1-tp0"))))
        llm.abort(request)
        finals, deadline = {}, time.monotonic() + 60
        while len(finals) < 1 + others:
            assert time.monotonic() < deadline, f"no final output for {({request, *rest}) - set(finals)}"
            finals.update({o.request_id: o for o in llm._engine.poll({request, *rest} - set(finals), True) if o.finished})
        assert finals[request].outputs[0].finish_reason in ("abort", "error")
        assert all(finals[r].outputs[0].finish_reason == "error" for r in rest)
        assert llm.generate("after", short)[0].outputs[0].token_ids == want
        assert llm.snapshot().num_rebuilds == 1
        assert_in_step(llm)
        (gone,) = llm._engine.poll({request}, True)  # collected already: the actor says so, once and final
        assert gone.finished and "unknown request" in gone.error
    with pytest.raises(EngineDeadError, match="this LLM was closed: start a new one"):
        llm.add_request("closed", short)
    assert released(), (vattn_actors(), live_placement_groups())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide the model's num_heads=4"),
        (dict(pipeline_parallel_size=3), "pipeline_parallel_size=3 is larger than the model's 2 layers"),
        (dict(tensor_parallel_size=2, device="cuda"), "tp=2 x pp=1 needs 2 GPUs; the Ray cluster has 0"),
        (dict(tensor_parallel_size=8, pipeline_parallel_size=2, model="llama-3-8b"),  # no weights load: refused first
         "16 CPU workers need 16 CPUs of the Ray cluster; it has 8"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an int >= 1, got 0"),
        (dict(preemption_mode="drop"), "preemption_mode must be 'recompute' or 'swap', got 'drop'"),
        (dict(async_scheduling="yes"), "async_scheduling must be a bool or None, got 'yes'"),
        (dict(async_depth=1), r"async_depth must be None or an int in \[2, 4\] \(steps in flight with async scheduling\), "
                              "got 1"),
        (dict(async_depth=True), r"async_depth must be None or an int in \[2, 4\] \(steps in flight with async scheduling\), "
                                 "got True"),
        (dict(tp_overlap_rows=-1), r"tp_overlap_rows must be an int >= 0 \(0: off\), got -1"),
        (dict(mixed_graph_tokens=-1), r"mixed_graph_tokens must be None or an int >= 0 \(0: off\), got -1"),
        (dict(pipeline_micro_batches=3), "pipeline_micro_batches must be None or an int >= 1 with "
                                         "pipeline_parallel_size > 1, got 3 with pipeline_parallel_size=1"),
        (dict(pipeline_handoff="nccl"), "pipeline_handoff must be 'auto', 'channel', 'p2p' or 'ring', got 'nccl'"),
        (dict(pipeline_handoff="ring", pipeline_parallel_size=2, pipeline_micro_batches=3),
         "pipeline_handoff='ring' runs a micro-batch a stage: pipeline_micro_batches must be None or 2, got 3"),
        (dict(kv_memory_fraction=0), r"kv_memory_fraction must be a number in \(0, 1\], got 0"),
        (dict(kv_memory_fraction=1.5), r"kv_memory_fraction must be a number in \(0, 1\], got 1.5"),
    ],
)
def test_impossible_shapes_are_refused_before_anything_starts(kwargs, message):
    kwargs = {"model": "tiny", "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=message):
        LLM(kwargs.pop("model"), distributed="ray", **kwargs)
    assert released(), (vattn_actors(), live_placement_groups())


def test_a_placement_group_that_cannot_be_placed_times_out_naming_the_numbers():
    from cluster.errors import PlacementError

    hog = ray.util.placement_group([{"CPU": 7}])  # leaves 1 of the 8 CPUs
    ray.get(hog.ready())
    try:
        start = time.monotonic()
        with pytest.raises(PlacementError, match=r"2 workers \(tp=2 x pp=1\) of \{'CPU': 1.0\} each, STRICT_PACK, "
                                                 r"could not be placed within 2.0 s"):
            LLM("tiny", distributed="ray", tensor_parallel_size=2, device="cpu", placement_timeout_s=2.0)
        assert time.monotonic() - start < 30
        assert vattn_actors() == [] and len(live_placement_groups()) == 1  # the hog alone
    finally:
        ray.util.remove_placement_group(hog)
