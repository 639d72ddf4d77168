"""Engine behaviour beyond greedy equality: parallel samples sharing pages, sampling controls, stops,
streaming, and bad input that leaves the engine serving."""

from __future__ import annotations

import gc
import re
from dataclasses import replace

import pytest
import torch

from cluster.engine import LLM
from cluster.errors import EngineDeadError
from cluster.sequence import Request, Sequence
from tests.cluster.conftest import step_ranges
from worker.config import PRESETS
from worker.loader import random_model
from worker.sampling import SampledToken, SamplingParams


@pytest.fixture
def llm():
    with LLM("tiny", kv_memory=16 << 20, max_num_seqs=8, max_model_len=256, page_size=4096, device="cpu") as engine:
        yield engine


def run(llm: LLM, prompt, params: SamplingParams):
    return llm.generate(prompt, params)[0]


def test_parallel_samples_share_the_prompt_pages():
    # No free slot prepared for later requests (eager_slots): what is mapped is this request's alone.
    with LLM("tiny", kv_memory=16 << 20, max_num_seqs=8, max_model_len=256, page_size=4096, device="cpu",
             eager_slots=0) as llm:
        prompt = list(range(3, 3 + 100))  # ~6 pages in the tiny model's mega layout
        params = SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=7, ignore_eos=True)
        request_id = llm.add_request(prompt, params)
        per_prompt = llm.cache.spec.physical_bytes_for(len(prompt))
        while len(llm.core._requests[request_id].seqs) < 4:
            llm.step()
        mapped = llm.cache.stats().mapped_bytes
        assert mapped < 4 * per_prompt  # one prompt copy plus the pages the samples wrote into
        assert mapped < 2 * per_prompt
        final = None
        while final is None:
            final = next((o for o in llm.step() if o.finished), None)
        samples = [c.token_ids for c in final.outputs]
        assert [c.index for c in final.outputs] == [0, 1, 2, 3]
        assert all(len(s) == 6 for s in samples)
        assert len(set(samples)) > 1  # different streams


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    a = run(llm, "hello", params).outputs[0].token_ids
    b = llm.generate(["other prompt", "hello"], [params, params])[1].outputs[0].token_ids  # different batch
    c = run(llm, "hello", replace(params, seed=124)).outputs[0].token_ids
    assert a == b
    assert a != c


def test_stop_token_ids_and_stop_strings(llm):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = run(llm, "abc", greedy).outputs[0]
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    out = run(llm, "abc", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])).outputs[0]
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"
    needle = next(ch for ch in full.text if ch.isalnum())  # the tiny model's greedy text has letters
    out = run(llm, "abc", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[needle])).outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(needle)]
    assert len(out.token_ids) < len(full.token_ids)
    kept = run(llm, "abc", replace(greedy, stop=[needle], include_stop_str_in_output=True)).outputs[0]
    assert kept.text == full.text[: full.text.index(needle) + 1] and kept.token_ids == out.token_ids


def test_logprobs_in_a_mixed_batch_belong_to_their_own_draws(llm):
    """Greedy and sampled rows, n > 1, different logprob counts and rows without logprobs in the same steps:
    each draw's logprob is its own token's in its own row's distribution (the top list agrees with it)."""
    params = [SamplingParams(max_tokens=6, temperature=0, n=2, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=4, logprobs=20, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, seed=2, logprobs=0, ignore_eos=True)]
    outputs = llm.generate(["abc", "hello there", "zz", "the quick brown fox"], params)
    for out, p in zip(outputs, params):
        for c in out.outputs:
            if p.logprobs is None:
                assert c.logprobs is None
                continue
            assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
            for lp in c.logprobs:
                assert len(lp.top_logprobs) == p.logprobs and lp.logprob <= 0
                if lp.token_id in lp.top_logprobs:
                    assert lp.logprob == pytest.approx(lp.top_logprobs[lp.token_id], abs=1e-6)
                if lp.top_logprobs:
                    assert lp.logprob <= max(lp.top_logprobs.values()) + 1e-6
                    if p.temperature == 0:
                        assert lp.logprob == pytest.approx(max(lp.top_logprobs.values()), abs=1e-6)


def test_logit_bias_steers_greedy_and_sampled_rows_and_their_logprobs_stay_the_models(llm):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = run(llm, "abc", greedy).outputs[0]
    forced = run(llm, "abc", replace(greedy, logit_bias={7: 100}, logprobs=1)).outputs[0]
    assert list(forced.token_ids) == [7] * 6
    assert all(lp.logprob < -0.5 and lp.top_logprobs.keys() != {7} for lp in forced.logprobs)  # the model's, unbiased
    banned = run(llm, "abc", replace(greedy, logit_bias={plain.token_ids[0]: -100})).outputs[0]
    assert banned.token_ids[0] != plain.token_ids[0]
    drawn = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias={9: 100}, ignore_eos=True)
    assert list(run(llm, "abc", drawn).outputs[0].token_ids) == [9] * 6
    with pytest.raises(ValueError, match=re.escape("logit_bias token ids must be in [0, ")):
        llm.generate("abc", replace(greedy, logit_bias={10**7: 1.0}))


def test_allowed_token_ids_are_all_a_row_draws_and_leave_the_others_alone(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = run(llm, "abc", greedy).outputs[0]
    allowed = sorted({7, 9, 11} - {plain.token_ids[0]})
    for params in (replace(greedy, allowed_token_ids=allowed), SamplingParams(max_tokens=12, temperature=1.0, seed=4,
                                                                             ignore_eos=True, allowed_token_ids=allowed)):
        outs = llm.generate(["abc", "abc"], [params, greedy])
        assert set(outs[0].outputs[0].token_ids) <= set(allowed) and outs[1].outputs[0].token_ids == plain.token_ids
    with pytest.raises(ValueError, match=re.escape("allowed_token_ids must be in [0, ")):
        llm.generate("abc", replace(greedy, allowed_token_ids=[10**7]))


def _forced_logprob(llm: LLM, prefix: list[int], token: int, k: int) -> SampledToken:
    """The model's logprob of ``token`` after ``prefix`` (and its top ``k``), from a one-token output forced to it."""
    params = SamplingParams(max_tokens=1, temperature=0, logit_bias={token: 100}, logprobs=k)
    return run(llm, prefix, params).outputs[0].logprobs[0]


@pytest.mark.parametrize("chunk", [16, 256])
def test_prompt_logprobs_are_each_prompt_tokens_logprob_given_those_before_it(chunk):
    """vLLM's ``prompt_logprobs``: entry i is what the model gives prompt token i after the first i (the first is
    None), with its top k -- the same numbers a one-token output forced to that token gets; across prefill chunks,
    a second request for the same prompt (no cached prefix skips its tokens) and preemption (nothing twice)."""
    prompt = [5, 17, 99, 3, 42, 7, 250, 11, 64, 128, 9, 1, 77] * 3
    asks = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    with LLM("tiny", kv_memory=16 << 20, max_num_seqs=8, max_model_len=256, page_size=4096, device="cpu",
             max_num_batched_tokens=chunk) as llm:
        for _ in range(2):
            got = run(llm, prompt, asks).prompt_logprobs
            assert len(got) == len(prompt) and got[0] is None
            for i in range(1, len(prompt)):
                want = _forced_logprob(llm, prompt[:i], prompt[i], 2)
                assert got[i].token_id == prompt[i] and got[i].top_logprobs.keys() == want.top_logprobs.keys()
                assert got[i].logprob == pytest.approx(want.logprob, abs=1e-5)
        assert run(llm, prompt, replace(asks, prompt_logprobs=None)).prompt_logprobs is None
    # Two requests that outgrow the pool together: one is preempted, and its prompt computed again.
    with LLM("tiny", kv_memory=28 * 4096, max_num_seqs=2, max_model_len=256, page_size=4096, device="cpu",
             max_num_batched_tokens=chunk) as small:
        outs = small.generate([prompt, prompt[::-1]], replace(asks, max_tokens=60))
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        for o, p in zip(outs, (prompt, prompt[::-1])):
            assert [t.token_id for t in o.prompt_logprobs[1:]] == p[1:]


def test_min_tokens_holds_back_eos_and_stop_token_ids(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    wants_eos = SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100})
    assert list(run(llm, "abc", wants_eos).outputs[0].token_ids) == [eos]
    held = run(llm, "abc", replace(wants_eos, min_tokens=3)).outputs[0]
    assert len(held.token_ids) == 4 and held.token_ids[-1] == eos and eos not in held.token_ids[:3]
    assert held.finish_reason == "stop"
    stop = SamplingParams(max_tokens=8, temperature=1.0, seed=2, logit_bias={11: 100}, stop_token_ids=[11], min_tokens=2)
    assert list(run(llm, "abc", stop).outputs[0].token_ids)[2:] == [11]


def test_min_p_of_one_draws_the_greedy_tokens(llm):
    greedy = run(llm, "hello there", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).outputs[0]
    drawn = run(llm, "hello there", SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0, seed=11, ignore_eos=True))
    assert drawn.outputs[0].token_ids == greedy.token_ids


def test_logprobs_are_returned(llm):
    out = run(llm, "abc", SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)).outputs[0]
    assert len(out.logprobs) == 3
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and lp.logprob <= 0 and len(lp.top_logprobs) == 2
        assert token in lp.top_logprobs  # greedy: the best alternative is the token itself


def test_stream_yields_growing_outputs(llm):
    seen = [o.outputs[0].token_ids for o in llm.stream("abc", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))]
    assert [len(s) for s in seen] == [1, 2, 3, 4, 5]
    assert all(seen[i] == seen[-1][: i + 1] for i in range(5))


def test_finished_requests_are_freed_without_the_cyclic_collector(llm):
    """A finished request, its sequences and their token lists go as soon as their outputs are built: the step loop's
    process never waits on a full collection of dead requests. Aborted ones too."""
    live = lambda: sum(type(o) in (Request, Sequence) for o in gc.get_objects())
    gc.collect()
    before = live()
    gc.disable()
    try:
        llm.generate(["abc", "de"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=2))
        ids = llm.core.add_requests(["fgh"], [SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)])
        llm.step()
        llm.core.abort(ids[0])
        while llm.core.has_work:
            llm.step()
        assert live() == before
    finally:
        gc.enable()


def test_a_failing_incremental_decoder_falls_back_to_whole_decodes(llm):
    """``tokenizers``' DecodeStream has raised on real tokenizers ("Invalid prefix encountered"): the sequence's
    text goes on, decoded whole, instead of the error failing every request in the step."""

    class Broken:
        def step(self, token_id):
            raise Exception("Invalid prefix encountered")

    rid = llm.add_request("abc", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    texts = []
    while llm.scheduler.has_work:
        for o in llm.step():
            texts.append(o.outputs[0].text)
            if len(o.outputs[0].token_ids) == 5:
                llm.core._requests[rid].seqs[0].detokenizer = Broken()  # the library's failure, from here on
            if not o.finished:
                assert o.outputs[0].text == llm.tokenizer.decode(list(o.outputs[0].token_ids)).rstrip("\ufffd")
    assert len(texts) == 24 and all(texts[-1].startswith(t) for t in texts)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ("x" * 300, {}, "prompt has 300 tokens; the maximum context is 256"),
        ([99999], {}, r"token ids must be ints in \[0, 512\)"),
        ("hi", {"max_tokens": 0}, "max_tokens must be an int > 0, got 0"),
        ("hi", {"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ("hi", {"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ("hi", {"n": 0}, "n must be an int >= 1, got 0"),
        ("hi", {"stop": [3]}, "stop must be a string or a list of strings"),
    ],
)
def test_bad_input_names_the_field_and_the_engine_keeps_serving(llm, prompt, params, message):
    good = llm.add_request("fine", SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match=message):
        llm.add_request(prompt, SamplingParams(**params))
    with pytest.raises(ValueError, match=message):
        llm.generate(["also fine", prompt], SamplingParams(**params))  # nothing of the batch is queued
    finished = []
    while llm.scheduler.has_work:
        finished += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == [good]


def test_request_that_can_never_fit_is_rejected():
    # tiny, mega: 2 layers x 2 KV heads x 32 dims x 4 bytes = 512 bytes a token in each of the K and V buffers,
    # so 8 tokens a page; 64 KiB is 8 pages of 4 KiB in both buffers.
    with LLM("tiny", kv_memory=64 << 10, max_num_seqs=4, max_model_len=2048, page_size=4096, device="cpu") as llm:
        with pytest.raises(ValueError, match="request needs 1510 tokens of KV cache in one slot, 189 pages; each "
                                             "worker's pool holds 8 for a request: it could never run"):
            llm.add_request("x" * 10, SamplingParams(max_tokens=1500))
        assert llm.generate("ok", SamplingParams(max_tokens=2, temperature=0))[0].finished


def test_a_kv_pool_past_the_free_memory_is_refused_at_start_naming_kv_memory():
    """On CPU the host's pages are taken only as the cache fills: a pool past the free memory used to start and be
    killed later (by Ray's memory monitor, again at every restart of the replica)."""
    import psutil

    too_much = 2 * psutil.virtual_memory().total
    with pytest.raises(ValueError, match=r"kv_memory: a KV pool of .* GiB is more than worker pp0 tp0's cpu memory "
                                         r"has free \(.* GiB\): lower kv_memory, or size the pool with kv_memory_fraction"):
        LLM("tiny", kv_memory=too_much, max_num_seqs=4, max_model_len=256, device="cpu")


@pytest.mark.parametrize("layout", ["mega", "paged"])
def test_a_kv_memory_fraction_sizes_the_pool_after_the_weights_load(layout):
    # 4 slots of 2048 tokens at 8 tokens a page (a 16-token block, paged): the pool stops at every slot full --
    # the running requests' slots: the virtual layout's 8 spare slots (for a freed slot to rest) add none.
    kw = dict(kv_layout=layout, max_num_seqs=4, max_model_len=2048, page_size=4096, device="cpu")
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM("tiny", kv_memory=1 << 20, **kw) as fixed:
        want = fixed.generate(["a b c", "hello"], greedy)
    with LLM("tiny", kv_memory_fraction=0.5, **kw) as llm:
        assert llm.core.plan.ledger_spec.max_slots == 4 + (8 if layout == "mega" else 0)
        assert llm.core.plan.num_pages == 4 * (256 if layout == "mega" else 128)
        assert llm.cache.accounting().free_pages == llm.core.plan.num_pages
        got = llm.generate(["a b c", "hello"], greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize(("layout", "fastest", "middle", "fallback"), [("mega", "flashinfer", "flash_attn", "fa2"),
                                                                 ("paged", "flashinfer_paged", "flash_attn_paged", "paged")])
def test_the_default_attention_on_cuda_is_the_fastest_installed(caplog, layout, fastest, middle, fallback):
    import importlib.util

    from cluster.config import EngineConfig, plan

    # plans only: no GPU needed. llama-3-8b's heads are 128 wide, a size FlashInfer has kernels for.
    chosen = plan(EngineConfig("llama-3-8b", device="cuda", kv_layout=layout), PRESETS["llama-3-8b"], "cuda")
    flash_attn, flashinfer = (importlib.util.find_spec(name) is not None for name in ("flash_attn", "flashinfer"))
    if flash_attn and flashinfer:
        assert chosen.attention == fastest
    elif flash_attn:
        assert chosen.attention == middle and "flashinfer does not import (No module named 'flashinfer'): prefill " \
                                              f"runs on flash-attn's FA2 kernels ({middle}), slower" in caplog.text
    else:
        assert chosen.attention == fallback and "flash-attn does not import (No module named 'flash_attn'): attention " \
                                                f"runs on torch's FlashAttention-2 ({fallback}), slower" in caplog.text
    # tiny's heads are 32 wide: FlashInfer is passed over without a word
    tiny = plan(EngineConfig("tiny", device="cuda", kv_layout=layout), PRESETS["tiny"], "cuda").attention
    assert tiny == (middle if flash_attn else fallback)
    # flash-attn's paged decode reads blocks of 256 tokens; the gather path keeps vLLM's 16
    assert chosen.ledger_spec.page_size == (256 if chosen.attention.endswith("_paged") else 16 if layout == "paged" else 2 << 20)
    assert plan(EngineConfig("tiny", device="cuda", attention="fa2"), PRESETS["tiny"], "cuda").attention == "fa2"


@pytest.mark.parametrize(("layout", "attention"), [("mega", "flashinfer"), ("paged", "flashinfer_paged")])
def test_flashinfer_needs_heads_it_has_kernels_for(layout, attention):
    from cluster.config import EngineConfig, plan

    with pytest.raises(ValueError, match=f"attention '{attention}' has kernels for head_dim 64 / 128 / 256, got 32"):
        plan(EngineConfig("tiny", device="cuda", kv_layout=layout, attention=attention), PRESETS["tiny"], "cuda")
    assert plan(EngineConfig("llama-3-8b", device="cuda", kv_layout=layout, attention=attention), PRESETS["llama-3-8b"],
                "cuda").attention == attention


@pytest.mark.parametrize("attention", ["flash_attn_paged", "flashinfer_paged"])
def test_the_paged_kernels_need_the_paged_layout_and_blocks_of_256_tokens(attention):
    from cluster.config import EngineConfig, plan

    with pytest.raises(ValueError, match=f"attention '{attention}' needs the paged KV layout on CUDA"):
        plan(EngineConfig("llama-3-8b", device="cuda", attention=attention), PRESETS["llama-3-8b"], "cuda")
    with pytest.raises(ValueError, match=f"attention '{attention}' reads blocks of a multiple of 256 tokens, got block_size=16"):
        plan(EngineConfig("llama-3-8b", device="cuda", kv_layout="paged", attention=attention, block_size=16), PRESETS["llama-3-8b"], "cuda")
    paged = plan(EngineConfig("llama-3-8b", device="cuda", kv_layout="paged", attention=attention), PRESETS["llama-3-8b"], "cuda")
    assert paged.workers[0].graph_batch > 0  # its reads fit a CUDA graph too
    assert paged.ledger_spec.page_size == 256


@pytest.mark.parametrize(("layout", "attention"), [("mega", "fa2"), ("mega", "flash_attn"), ("paged", "flash_attn"),
                                                  ("paged", "flashinfer")])
def test_in_place_attention_needs_a_virtual_layout_on_cuda(layout, attention):
    with pytest.raises(ValueError, match=f"attention '{attention}' needs a virtual KV layout"):
        LLM("tiny", kv_layout=layout, attention=attention, device="cpu")


def test_cuda_graphs_default_on_every_tp_rank_and_pipeline_stage():
    from cluster.config import EngineConfig, plan

    def graphs(**kw):  # plans only: no GPU needed
        config = EngineConfig("llama-3-8b", device="cuda", attention="fa2", distributed="ray", max_num_seqs=128, **kw)
        chosen = plan(config, PRESETS["llama-3-8b"], "cuda")
        return [(w.graph_batch, w.scratch_slot) for w in chosen.workers]

    assert graphs(tensor_parallel_size=2) == [(128, 0)] * 2  # every rank captures, over the same scratch slot
    # every stage its layers, for the micro-batch a step takes (a stage's share of the sequences)
    assert graphs(pipeline_parallel_size=2) == [(64, 0)] * 2
    assert graphs(tensor_parallel_size=2, pipeline_parallel_size=2) == [(64, 0)] * 4
    assert graphs(pipeline_parallel_size=2, pipeline_micro_batches=3) == [(43, 0)] * 2
    assert graphs(pipeline_parallel_size=2, async_scheduling=False) == [(128, 0)] * 2  # one step at a time: all
    assert graphs(tensor_parallel_size=2, cuda_graphs=False) == [(0, None)] * 2
    assert graphs(pipeline_parallel_size=2, cuda_graphs=False) == [(0, None)] * 2


def test_mixed_step_graphs_go_to_every_worker_with_graphs_up_to_a_steps_tokens():
    from cluster.config import EngineConfig, plan

    def tokens(**kw):  # plans only: no GPU needed
        config = EngineConfig("llama-3-8b", device="cuda", attention="fa3", distributed="ray", **kw)
        return [w.mixed_graph_tokens for w in plan(config, PRESETS["llama-3-8b"], "cuda").workers]

    assert tokens() == [2048]  # on by default on one GPU
    assert tokens(tensor_parallel_size=2) == tokens(pipeline_parallel_size=2) == [0] * 2  # not yet run across GPUs
    assert tokens(mixed_graph_tokens=2048, tensor_parallel_size=2) == [2048] * 2  # unless asked for
    assert tokens(max_num_batched_tokens=1024) == [1024]  # no step has more
    assert tokens(mixed_graph_tokens=0) == tokens(mixed_graph_tokens=2048, cuda_graphs=False) == [0]
    assert plan(EngineConfig("tiny", device="cpu"), PRESETS["tiny"], "cpu").workers[0].mixed_graph_tokens == 0


def test_pipeline_stages_keep_a_micro_batch_each_in_flight_or_as_many_as_asked():
    from cluster.config import EngineConfig, plan

    def shape(distributed="ray", **kw):
        config = EngineConfig("tiny", device="cpu", distributed=distributed, max_num_seqs=128, **kw)
        chosen = plan(config, PRESETS["tiny"], "cpu")
        return chosen.steps_in_flight, chosen.scheduler.micro_batches, chosen.pipeline_handoff

    # a token ring by default: a micro-batch a stage, and the next step of one queued behind the step it takes from
    assert shape(pipeline_parallel_size=2) == (3, 2, "ring")
    assert shape(pipeline_parallel_size=2, pipeline_handoff="channel") == (2, 2, "channel")
    assert shape(pipeline_parallel_size=2, pipeline_handoff="p2p") == (2, 2, "p2p")
    # more micro-batches than stages, or one step at a time: no ring, the channel unless another hand-off is named
    assert shape(pipeline_parallel_size=2, pipeline_micro_batches=3) == (3, 3, "channel")
    assert shape(pipeline_parallel_size=2, pipeline_micro_batches=3, pipeline_handoff="p2p") == (3, 3, "p2p")
    assert shape(pipeline_parallel_size=2, async_scheduling=False) == (1, 1, "channel")
    assert shape(pipeline_parallel_size=2, async_scheduling=False, pipeline_handoff="ring") == (1, 1, "p2p")
    # one stage: steps queued behind the running one over the same sequences, three through Ray, two in-process
    assert shape() == (3, 1, "channel")
    assert shape(async_depth=2) == (2, 1, "channel")
    assert shape("local") == (2, 1, "channel")
    assert shape("local", async_depth=3) == (3, 1, "channel")


def test_graphs_with_a_gathering_backend_are_refused_before_loading():
    with pytest.raises(ValueError, match="cuda_graphs need an attention backend that reads the cache in place"):
        LLM("tiny", attention="torch", cuda_graphs=True, device="cpu")


def test_flash_kernels_refuse_a_head_dim_they_would_pad():
    # Nothing touches CUDA before this check, so it runs on a CPU machine too.
    model = random_model(replace(PRESETS["tiny"], head_dim=12), torch.float32, "cpu")
    with pytest.raises(ValueError, match="attention 'fa2' needs head_dim a multiple of 8, got 12"):
        LLM(model, attention="fa2", device="cuda", dtype="float32")


@pytest.mark.parametrize("attention", ["fa2", "flash_attn", "paged"])
def test_flash_kernels_refuse_float32_before_loading(attention):
    # Seen on the H100: float32 reached torch's FlashAttention at the first step ("only support fp16 and bf16").
    layout = "paged" if attention == "paged" else "mega"
    with pytest.raises(ValueError, match=f"attention '{attention}' runs FlashAttention kernels, which take float16 or "
                                         "bfloat16: got dtype='float32'"):
        LLM("tiny", attention=attention, kv_layout=layout, device="cuda", dtype="float32")


def test_a_float32_engine_on_cuda_defaults_to_the_reference_attention():
    from cluster.config import EngineConfig, plan

    assert plan(EngineConfig(model="tiny", dtype="float32"), PRESETS["tiny"], "cuda").attention == "torch"
    assert plan(EngineConfig(model="tiny", dtype="float32", kv_layout="paged"), PRESETS["tiny"], "cuda").attention == "torch"


def test_recovery_fails_what_ran_requeues_what_waited_and_keeps_sequence_ids_unique():
    from cluster.errors import WorkerGroupError

    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    kw = dict(kv_memory=16 << 20, max_num_seqs=2, max_model_len=256, page_size=4096, device="cpu")
    with LLM("tiny", **kw) as reference:
        want = [o.outputs[0].token_ids for o in reference.generate(["w1", "w2", "w3"], greedy)]
    with LLM("tiny", **kw) as llm:
        running = [llm.add_request(p, greedy) for p in ("r1", "r2")]
        waiting = [llm.add_request(p, greedy) for p in ("w1", "w2", "w3")]
        for _ in range(3):
            llm.step()
        failed = llm.core.recover(WorkerGroupError("step 3 failed: test"))
        assert sorted(o.request_id for o in failed) == sorted(running)
        assert all(o.finished and o.outputs[0].finish_reason == "error" and "step 3 failed: test" in o.error for o in failed)
        late = [llm.add_request(p, greedy) for p in ("w1", "w2", "w3")]  # numbered after the kept sequences
        ids = [s.seq_id for r in llm.core._requests.values() for s in r.seqs]
        assert len(ids) == len(set(ids)) == 6
        done = {}
        while llm.scheduler.has_work:
            done.update({o.request_id: o for o in llm.step() if o.finished})
        assert [done[i].outputs[0].token_ids for i in (*waiting, *late)] == [*want, *want]
        assert llm.core.ledger.accounting() == llm.cache.accounting()


def test_an_abort_ends_its_stream_finished_even_before_the_first_sample(llm):
    params = SamplingParams(max_tokens=50, temperature=1.0, n=3, seed=1, ignore_eos=True)
    early = llm.add_request(list(range(3, 200)), params)  # aborted while its prompt is still in prefill
    llm.abort(early)
    (out,) = llm.step()
    assert (out.request_id, out.finished) == (early, True)
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(0, "abort"), (1, "abort"), (2, "abort")]  # all n
    seen = []
    for o in llm.stream(["a", "b"], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)):
        seen.append(o)
        if not o.finished and o.request_id == "2" and len(o.outputs[0].token_ids) == 3:
            llm.abort(o.request_id)  # the stream ends it (it used to wait for it forever)
    last = {o.request_id: o for o in seen}
    assert last["2"].finished and last["2"].outputs[0].finish_reason == "abort"
    assert len(last["2"].outputs[0].token_ids) == 3 and last["1"].outputs[0].finish_reason == "length"
    llm.abort("2")  # finished: ignored
    assert llm.step() == [] and llm.cache.stats().slots_in_use == 0


class Around:
    """The real in-process executor; subclasses wrap its ``submit``."""

    def __init__(self, executor):
        self.inner = executor

    def submit(self, step):
        return self.inner.submit(step)

    def execute(self, step):
        return self.submit(step).result()

    def rebuild(self):
        self.inner.rebuild()

    def close(self):
        self.inner.close()


class FailingFlushes(Around):
    """The messages ``fails`` picks fail as a dead worker group's would (by default a message with no batch: a flush)."""

    def __init__(self, executor, fails=lambda step: not step.seq_ids):
        super().__init__(executor)
        self.fails = fails

    def submit(self, step):
        from cluster.errors import WorkerGroupError

        if self.fails(step):
            raise WorkerGroupError(f"step {step.step} failed: test")
        return self.inner.submit(step)


def test_a_failed_flush_keeps_the_finished_outputs_and_fails_the_next_step():
    from cluster.errors import WorkerGroupError

    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM("tiny", kv_memory=16 << 20, max_num_seqs=4, max_model_len=256, page_size=4096, device="cpu") as llm:
        (want,) = llm.generate("a", greedy)
        llm.core.executor = FailingFlushes(llm.core.executor)
        (done,) = llm.generate("a", greedy)  # the last step's flush fails after its outputs were made
        assert done.outputs[0].token_ids == want.outputs[0].token_ids and done.error is None
        llm.add_request("b", greedy)
        with pytest.raises(WorkerGroupError, match=r"step \d+ failed: test"):
            llm.step()
        assert llm.core.recover(WorkerGroupError("test")) == []  # "b" had not started: kept
        llm.core.executor = llm.core.executor.inner
        finished = []
        while llm.scheduler.has_work:
            finished += [o for o in llm.step() if o.finished]
        assert [o.outputs[0].finish_reason for o in finished] == ["length"]
        assert llm.core.ledger.accounting() == llm.cache.accounting()


def test_an_abort_before_a_failed_step_still_ends_its_request():
    from cluster.errors import WorkerGroupError

    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM("tiny", kv_memory=16 << 20, max_num_seqs=4, max_model_len=256, page_size=4096, device="cpu") as llm:
        a, b = llm.add_request("a", greedy), llm.add_request("b", greedy)
        llm.step()
        llm.abort(a)  # b still runs: no flush, the abort waits for the next step
        llm.core.executor = FailingFlushes(llm.core.executor, fails=lambda step: True)
        with pytest.raises(WorkerGroupError):
            llm.step()
        llm.core.executor = llm.core.executor.inner
        outputs = {o.request_id: o for o in llm.core.recover(WorkerGroupError("test"))}
        assert outputs[a].outputs[0].finish_reason == "abort" and outputs[b].outputs[0].finish_reason == "error"
        assert llm.core.requests == set() and llm.core.ledger.accounting() == llm.cache.accounting()
    with pytest.raises(EngineDeadError, match="this LLM was closed"):
        llm.step()


class FailingRebuilds(FailingFlushes):
    def rebuild(self):
        raise RuntimeError("no GPU left: test")


def test_a_failed_rebuild_leaves_every_request_its_final_output():
    from cluster.errors import WorkerGroupError

    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM("tiny", kv_memory=16 << 20, max_num_seqs=1, max_model_len=256, page_size=4096, device="cpu") as llm:
        running, waiting = llm.add_request("a", greedy), llm.add_request("b", SamplingParams(max_tokens=4, n=2))
        llm.step()
        llm.core.executor = FailingRebuilds(llm.core.executor, fails=lambda step: False)
        with pytest.raises(RuntimeError, match="no GPU left: test"):
            llm.core.recover(WorkerGroupError("test"))
        outputs = {o.request_id: o for o in llm.core.fail_all("the engine is dead: test")}
        assert set(outputs) == {running, waiting} and all(o.finished and o.error for o in outputs.values())
        assert "in flight" in outputs[running].error  # recover's own message, not lost with the rebuild
        assert [c.finish_reason for c in outputs[waiting].outputs] == ["error", "error"]
        llm.core.executor = llm.core.executor.inner


class CountsInFlight(Around):
    """Counts the steps submitted whose result was not taken yet."""

    def __init__(self, executor):
        super().__init__(executor)
        self.in_flight = self.most = 0

    def submit(self, step):
        pending = self.inner.submit(step)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        counter = self

        class Counted:
            def result(self):
                counter.in_flight -= 1
                return pending.result()

        return Counted()


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_gives_the_sync_engines_outputs(mode, depth):
    """Two (or three) steps in flight, tokens fed back as placeholders, stops found a step (two) late, preemption of
    sequences in flight, n > 1 forks from a parent still in flight: the same outputs as one step at a time."""
    prompts = ["abc", "hello there", list(range(5, 60)), "the quick brown fox", list(range(90, 100)), "zz"]
    tiny = dict(kv_memory=12 * 8192, max_num_seqs=6, max_model_len=128, page_size=4096, device="cpu",
                max_num_batched_tokens=24, preemption_mode=mode, swap_space=1 << 20)  # 12 pages: preempts

    def params(stop_id: int | None) -> list[SamplingParams]:
        stops = [stop_id] if stop_id is not None else []
        return [
            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=stops),
            SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=5, ignore_eos=True, stop_token_ids=stops),
            SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=9, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, stop=["e"]),
            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0.7, n=2, seed=1),
        ]

    def run_all(overlap: bool, stop_id: int | None):
        with LLM("tiny", async_scheduling=overlap, async_depth=depth, **tiny) as llm:
            llm.core.executor = counting = CountsInFlight(llm.core.executor)
            outputs = llm.generate(prompts, params(stop_id))
            llm.core.executor = counting.inner
            assert llm.core.ledger.accounting() == llm.cache.accounting()
            assert (llm.cache.stats().slots_in_use, llm.cache.stats().used_bytes) == (0, 0)
            assert llm.scheduler.num_preemptions > 0 and counting.in_flight == 0
            assert counting.most == (depth if overlap else 1)
            return [[(c.token_ids, c.finish_reason, c.text, c.logprobs) for c in o.outputs] for o in outputs]

    plain = run_all(False, None)
    stop_id = plain[0][0][0][5]  # greedy request 0 stops at its 6th token (or earlier), sample streams maybe too
    sync = run_all(False, stop_id)
    assert sync[0][0][1] == "stop" and len(sync[0][0][0]) <= 6
    assert run_all(True, stop_id) == sync


def test_a_placeholder_for_a_sequence_never_sampled_is_refused(llm):
    from worker.messages import PLACEHOLDER, NewSeq, StepInput

    executor = llm.core.executor
    slot = llm.core.ledger.alloc_slot(4)
    llm.core.ledger.ensure(slot, 4)
    step = StepInput(10**6, (NewSeq(999, SamplingParams(), 0, 0),), (), llm.core.ledger.take_ops(), {}, (999,), (slot,),
                     (0,), (1,), (0,), (5, 6, 7, PLACEHOLDER), (0, 4))
    with pytest.raises(ValueError, match="step 1000000: seq 999 ends in a placeholder, but no token was sampled for it"):
        executor.execute(step)


class FailsResults(Around):
    """A step's result fails (as a dead worker group's would) once ``arm_when()`` held right after a schedule."""

    def __init__(self, executor, arm_when):
        super().__init__(executor)
        self.arm_when, self.armed = arm_when, False

    def submit(self, step):
        from cluster.errors import WorkerGroupError

        pending, outer = self.inner.submit(step), self
        self.armed = self.armed or self.arm_when()

        class Failing:
            def result(self):
                out = pending.result()
                if outer.armed:
                    raise WorkerGroupError(f"step {step.step} failed: test")
                return out

        return Failing()


def test_recovery_restarts_a_sequence_preempted_while_its_token_was_in_flight():
    """(Found in review.) Step k draws X's first token; step k+1's schedule preempts X (recompute); step k fails.
    X has not started for its client, so recovery keeps it -- and must drop the token it will never get."""
    from cluster.errors import WorkerGroupError
    from cluster.sequence import SeqStatus

    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 35)), list(range(105, 128)), list(range(205, 235))]
    kw = dict(kv_memory=12 * 8192, max_num_seqs=6, max_model_len=128, page_size=4096, device="cpu", max_num_batched_tokens=24)
    with LLM("tiny", **kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    with LLM("tiny", async_scheduling=True, **kw) as llm:
        core, found = llm.core, []

        def victim() -> bool:
            found[:] = [s for r in core._requests.values() for s in r.seqs
                        if s.status is SeqStatus.WAITING and s.pending and not s.num_output_tokens]
            return bool(found)

        core.executor = failing = FailsResults(core.executor, victim)
        ids = [llm.add_request(p, greedy) for p in prompts]
        with pytest.raises(WorkerGroupError):
            for _ in range(200):
                llm.step()
        (x,) = found
        failed = {o.request_id for o in core.recover(WorkerGroupError("test"))}
        core.executor = failing.inner
        assert x.request.request_id not in failed and x.pending == 0
        done = {}
        while core.has_work:
            done.update({o.request_id: o for o in llm.step() if o.finished})
        out = done[x.request.request_id]
        assert out.error is None and out.outputs[0].token_ids == want[ids.index(x.request.request_id)]


@pytest.mark.parametrize("overlap", [False, True])
def test_an_engine_done_with_its_requests_holds_nothing(overlap):
    """(Found in review.) The last request stops on a token found a step late: its wasted row is still in flight
    when its final output is made. generate() returns only once the workers hold no slot of it."""
    kw = dict(kv_memory=16 << 20, max_num_seqs=6, max_model_len=128, page_size=4096, device="cpu",
              max_num_batched_tokens=24)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM("tiny", async_scheduling=overlap, **kw) as llm:
        stop = llm.generate("abc", greedy)[0].outputs[0].token_ids[3]
        (out,) = llm.generate("abc", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop]))
        assert out.outputs[0].finish_reason == "stop"
        assert not llm.core.has_work and llm.cache.stats().slots_in_use == 0
        assert llm.core.ledger.accounting() == llm.cache.accounting()


@pytest.mark.parametrize("overlap", [False, True])
def test_mapping_in_the_step_and_eager_reclamation_give_the_same_tokens(overlap):
    """The allocation-latency experiment's switches: pages mapped in the step instead of ahead on the mapper
    thread, and freed slots unmapped at once instead of kept for the next request (without prefix caching,
    which holds finished requests' blocks)."""
    kw = dict(kv_memory=16 << 20, max_num_seqs=4, max_model_len=128, page_size=4096, device="cpu",
              max_num_batched_tokens=32, async_scheduling=overlap, enable_prefix_caching=False)
    prompts = [list(range(5, 60)), "hello there", list(range(90, 100)), "the quick brown fox", "zz", "abc"]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    runs = {}
    for ahead, deferred in [(True, True), (False, True), (True, False)]:
        with LLM("tiny", map_ahead=ahead, deferred_reclamation=deferred, **kw) as llm:
            runs[ahead, deferred] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
            stats = llm.cache.stats()
            assert llm.core.ledger.accounting() == llm.cache.accounting() and stats.slots_in_use == 0
            # mapped: the pages free slots keep for their next request
            assert (stats.unmaps > 0 and stats.mapped_bytes == 0) if not deferred else (stats.unmaps == 0 and stats.mapped_bytes > 0)
    assert runs[False, True] == runs[True, True] == runs[True, False]


def test_a_zero_page_everywhere_only_as_a_guard_or_none_gives_the_same_tokens():
    """How unmapped KV space is backed changes no token: shared prefixes (cached, mapped into new slots) under
    memory pressure (reclaim, eviction), the host VMM refusing what CUDA refuses (a mapping over a mapping)."""
    kw = dict(kv_memory=96 * 4096 * 2, max_num_seqs=4, max_model_len=256, page_size=4096, device="cpu",
              max_num_batched_tokens=64)
    system = list(range(7, 120))
    prompts = [system + [200 + i, 300 + i] for i in range(6)] + ["hello there", list(range(40, 160))]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for backing in [dict(kv_guard_tokens=None), dict(kv_guard_tokens=8), dict(zero_unmapped=False)]:
        with LLM("tiny", **backing, **kw) as llm:
            runs[str(backing)] = [[o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] for _ in range(2)]
            assert llm.scheduler.prefix_hits > 0 and llm.cache.stats().unmaps > 0  # pages reclaimed or evicted
            assert llm.core.ledger.accounting() == llm.cache.accounting()
    first, *others = runs.values()
    assert all(run == first for run in others)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(block_size=0), "block_size must be an int >= 1 (tokens a block of the paged layout), got 0"),
    (dict(block_size="256"), "block_size must be an int >= 1 (tokens a block of the paged layout), got '256'"),
    (dict(map_ahead="no"), "map_ahead must be a bool, got 'no'"),
    (dict(deferred_reclamation=None), "deferred_reclamation must be a bool, got None"),
    (dict(zero_unmapped=1), "zero_unmapped must be a bool, got 1"),
    (dict(kv_guard_tokens=0), "kv_guard_tokens must be None or an int >= 1, got 0"),
    (dict(kv_guard_tokens=True), "kv_guard_tokens must be None or an int >= 1, got True"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a number in (0, 1], got 1.5"),
    (dict(gpu_memory_utilization=0.8, kv_memory_fraction=0.5),
     "set kv_memory_fraction (0.5) or gpu_memory_utilization (0.8), not both"),
    (dict(gpu_memory_utilization=0.8), "gpu_memory_utilization=0.8 sizes the KV pool by GPU memory; device is 'cpu' "
                                       "(set kv_memory or kv_memory_fraction)"),
])
def test_bad_paging_options_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM("tiny", kv_layout="paged", device="cpu", **kwargs)


def test_a_worker_forgets_sequences_that_ended_while_their_next_step_was_in_flight():
    """(Found in review.) A stop token is seen a step late: the worker had drawn the sequence's next token
    already, and must not keep it after the sequence is gone."""
    kw = dict(kv_memory=16 << 20, max_num_seqs=6, max_model_len=128, page_size=4096, device="cpu", async_scheduling=True)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM("tiny", **kw) as llm:
        stops = [llm.generate(p, greedy)[0].outputs[0].token_ids[3] for p in ("abc", "hello", "zz")]
        outs = llm.generate(["abc", "hello", "zz"], [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                                    stop_token_ids=[s]) for s in stops])
        assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * 3
        worker = llm.core.executor.worker
        assert worker._seqs == {} and worker._last == {}


def test_the_engine_seed_makes_requests_without_one_reproducible(hf_llama):
    """vLLM's ``--seed``: requests that bring no seed draw the engine's next ones, so a run repeats under the same
    engine seed and not under another (a checkpoint's weights do not depend on it)."""
    def run(seed: int) -> list[list[int]]:
        with LLM(hf_llama[0], device="cpu", dtype="float32", seed=seed, max_model_len=128, kv_memory=4 << 20) as llm:
            params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
            return [list(o.outputs[0].token_ids) for o in llm.generate([[5, 6, 7]] * 3, params)]

    first, again, other = run(1), run(1), run(2)
    assert first == again and first != other and len({tuple(t) for t in first}) == 3


def test_the_engine_takes_the_tokenizer_and_chat_template_it_is_given(tmp_path):
    from tests.worker.test_detokenizer import trained

    trained("byte_level", tmp_path)
    with LLM("tiny", device="cpu", max_model_len=64, kv_memory=4 << 20, tokenizer=str(tmp_path / "byte_level"),
             chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}") as llm:
        assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<hi>"
        (out,) = llm.generate("The fox", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert list(out.prompt_token_ids) == llm.tokenizer.encode("The fox") != list(b"The fox")



def test_a_profile_records_each_step_as_a_range_named_after_what_it_runs(llm, tmp_path):
    llm.start_profile(tmp_path)
    with pytest.raises(RuntimeError, match="already recording"):
        llm.start_profile(tmp_path)
    llm.generate([[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert llm.stop_profile() == [str(tmp_path / "vattn_pp0_tp0.pt.trace.json.gz")]
    # both prompts in one step (drawing each's first token), then two decode steps; steps with KV operations only
    # (no batch) are left out here
    steps = [s for s in step_ranges(str(tmp_path / "vattn_pp0_tp0.pt.trace.json.gz")) if not s.endswith("_seqs(0)")]
    assert steps == [
        "vattn_step_prefill(8)_decode(0)_seqs(2)"] + ["vattn_step_prefill(0)_decode(2)_seqs(2)"] * 2
    # the mapper thread's work is there too, to set beside the launches its driver calls can hold up
    assert "kvmem_map_ahead" in step_ranges(str(tmp_path / "vattn_pp0_tp0.pt.trace.json.gz"), "kvmem_map")
    # and the launch's parts on the host, between its kernels' launches
    phases = set(step_ranges(str(tmp_path / "vattn_pp0_tp0.pt.trace.json.gz"), "vattn_phase_"))
    assert phases == {f"vattn_phase_{p}" for p in ("map_wait", "kv_ops", "plan", "tp_agree", "queue")}
    with pytest.raises(RuntimeError, match="not recording"):
        llm.stop_profile()


@pytest.mark.parametrize("during_launch", [False, True])
def test_the_next_steps_pages_are_mapped_once_a_steps_kernels_are_queued_not_while_they_are(monkeypatch, during_launch):
    # The mapper's driver calls beside a launch can hold the step's kernels back (on the H200, 0.42 s more device
    # time on peer.py's `prefix`): the worker submits the next step's mapping plan after the launch. The order before
    # (VATTN_MAP_DURING_LAUNCH=1) shows that the probe sees the mapper's maps where they happen.
    if during_launch:
        monkeypatch.setenv("VATTN_MAP_DURING_LAUNCH", "1")
    with LLM("tiny", kv_memory=16 << 20, max_num_seqs=8, max_model_len=256, page_size=4096, device="cpu") as engine:
        worker = engine.core.executor.worker
        cache, launch, during = worker.cache, worker.runner.launch, []

        def watched(plan, inputs):
            maps = cache.counters()[0]
            launched = launch(plan, inputs)
            during.append(cache.counters()[0] - maps)
            return launched

        worker.runner.launch = watched
        prompts = [[(7 * i + j) % 200 + 1 for j in range(20 + 9 * i)] for i in range(8)]
        engine.generate(prompts, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
        mapped = cache.counters()[0]
    assert len(during) >= 60 and mapped > 50  # steps whose next step grew: plans with pages to map
    assert (sum(during) > 0) == during_launch
