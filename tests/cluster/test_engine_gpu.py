"""The whole engine on the GPU: FA2 (torch's, and flash-attn's where installed) over the virtual cache with
CUDA-graph decode, and the paged cache through the gather path and through flash-attn's block tables, against the eager reference attention on the same weights (bf16, so a near-tie may flip a token:
the first token of every prompt must match and nearly all the rest)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from cluster.engine import LLM
from tests.cluster.conftest import NEW_TOKENS
from tests.conftest import cuda_missing, needs_attention
from worker.config import PRESETS
from worker.loader import random_model
from worker.mixed_graphs import TOKEN_BUCKETS
from worker.sampling import SamplingParams

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def generate(path: str, prompts: list[list[int]], layout: str, attention: str, graphs: bool) -> list[list[int]]:
    with LLM(path, kv_layout=layout, attention=attention, cuda_graphs=graphs, dtype="bfloat16", device="cuda",
             max_num_seqs=8, max_model_len=128, kv_memory=64 << 20) as llm:
        outputs = llm.generate(prompts, GREEDY)
        assert llm.cache.stats().slots_in_use == (1 if graphs else 0)  # the graphs' scratch slot only
        return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize(("layout", "attention", "graphs"), [
    ("mega", "fa2", True), ("per_layer", "fa2", True), ("mega", "fa2", False), ("paged", "paged", False),
    ("mega", "flash_attn", True), ("per_layer", "flash_attn", False),
    ("paged", "flash_attn_paged", True), ("paged", "flash_attn_paged", False),
])
def test_fast_paths_agree_with_the_reference_engine(hf_model, layout, attention, graphs):
    needs_attention(attention)
    agree_with_the_reference(hf_model, layout, attention, graphs)


@pytest.mark.parametrize(("layout", "attention", "graphs"), [
    ("mega", "flashinfer", True), ("per_layer", "flashinfer", False), ("paged", "flashinfer_paged", True),
    ("mega", "fa3", True), ("per_layer", "fa3", False),
])
def test_head_dim_128_kernels_agree_with_the_reference_engine(hf_llama128, layout, attention, graphs):
    needs_attention(attention)
    agree_with_the_reference(hf_llama128, layout, attention, graphs)


def agree_with_the_reference(hf_model, layout: str, attention: str, graphs: bool) -> None:
    path, prompts, _ = hf_model
    want = generate(path, prompts, "mega", "torch", False)
    got = generate(path, prompts, layout, attention, graphs)
    assert [g[0] for g in got] == [w[0] for w in want]
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.8 * sum(map(len, want)), f"only {same} of {sum(map(len, want))} tokens agree"


def test_a_kv_memory_fraction_takes_that_share_of_what_the_weights_leave():
    if cuda_missing():
        pytest.skip(cuda_missing())
    import torch

    # yi-6b: 12 GiB of bf16 weights, 64 KiB of KV a token; 256 slots of 4096 tokens would map 64 GiB, so half of
    # what an 80 GiB GPU has left is under that cap and the fraction decides.
    with LLM("yi-6b", kv_memory_fraction=0.5, device="cuda", max_num_seqs=256, max_model_len=4096,
             cuda_graphs=False) as llm:
        pool = llm.core.plan.workers[0].pool_bytes
        free, _ = torch.cuda.mem_get_info()
        assert 0.45 < pool / (free + pool) < 0.55, (pool, free)  # what was free before the pool: free now + pool
        out = llm.generate([[1, 2, 3, 4]] * 8, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 16 for o in out)
        assert llm.cache.stats().slots_in_use == 0


def test_gpu_memory_utilization_leaves_the_rest_of_the_gpu_free():
    """vLLM's sizing: the engine may use that share of the GPU's whole memory, and the KV pool takes what the
    weights leave of it (not written to run on CPU: it has no GPU to share)."""
    if cuda_missing():
        pytest.skip(cuda_missing())
    import torch

    with LLM("yi-6b", gpu_memory_utilization=0.5, device="cuda", max_num_seqs=256, max_model_len=4096,
             cuda_graphs=False) as llm:
        free, total = torch.cuda.mem_get_info()
        assert 0.4 < free / total < 0.52, (free, total)  # half left, less what the runner took after the pool
        out = llm.generate([[1, 2, 3, 4]] * 8, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 16 for o in out)


@pytest.mark.parametrize(("layout", "attention"), [("mega", "fa2"), ("mega", "flash_attn"), ("paged", "flash_attn_paged"),
                                                  ("mega", "flashinfer"), ("paged", "flashinfer_paged"), ("mega", "fa3")])
def test_async_scheduling_on_the_gpu_gives_the_sync_engines_outputs(hf_llama128, layout, attention):
    """Step k+1 (and k+2, ``async_depth=3``) launched before step k's tokens are read: placeholders filled from tokens
    still on the device,
    tokens read through pinned copies, slots freed and reused while a step is queued, CUDA graphs and eager
    mixed steps, seeded sampling, n > 1, logprobs. bf16 batches differ in composition between the two modes,
    so a near-tie may flip a token: the first tokens must match and nearly all the rest."""
    needs_attention(attention)
    model = hf_llama128[0] if attention.startswith("flashinfer") or attention == "fa3" else "tiny"
    prompts = [list(range(5, 40)), list(range(100, 103)), list(range(200, 290)), [7, 8, 9, 10], list(range(270, 310))] * 2
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=9, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=40, temperature=0.7, n=2, seed=1, ignore_eos=True),
    ] * 2

    def run(overlap: bool, depth: int = 2):
        with LLM(model, kv_layout=layout, attention=attention, async_scheduling=overlap, async_depth=depth,
                 dtype="bfloat16", device="cuda", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64) as llm:
            outputs = llm.generate(prompts, params)
            assert llm.core.ledger.accounting() == llm.cache.accounting()
            assert llm.cache.stats().slots_in_use == 1  # the graphs' scratch slot only
            return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]

    sync = run(False)
    for overlapped in (run(True), run(True, depth=3)):
        assert [[len(c[0]) for c in o] for o in overlapped] == [[len(c[0]) for c in o] for o in sync]
        assert [o[0][0][0] for o in overlapped] == [o[0][0][0] for o in sync]
        pairs = [(a, b) for o, w in zip(overlapped, sync) for c, d in zip(o, w) for a, b in zip(c[0], d[0])]
        agree = sum(a == b for a, b in pairs)
        assert agree >= 0.9 * len(pairs), f"only {agree} of {len(pairs)} agree"


def test_async_scheduling_under_memory_pressure_reclaims_slots_freed_while_a_step_is_queued(tmp_path):
    """Requests end and are preempted every few steps, and new ones need the pages that finished ones left
    mapped: the worker frees a slot without waiting for the step in flight (which may still read it), and the
    reclaim that unmaps its pages waits for that step. A missed wait reads unmapped memory (a CUDA fault) or
    wrong K/V. Random weights, 256 tokens per 2 MiB page; bf16 (flash kernels), so batch composition moves the
    log-probs by rounding and may flip a near-tie: tokens must nearly all agree, and their log-probs closely."""
    import json

    needs_attention("fa2")

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 16,
              "head_dim": 128, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([150, 40, 260, 90, 200, 30, 310, 120] * 3)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=0)
              for m in [60, 140, 20, 90, 45, 200, 10, 75] * 3]

    def run(overlap: bool):
        torch.manual_seed(0)  # the same random weights in both engines
        with LLM(str(tmp_path), load_format="dummy", async_scheduling=overlap, dtype="bfloat16", device="cuda",
                 attention="fa2", max_num_seqs=8, max_model_len=512, max_num_batched_tokens=256,
                 kv_memory=8 * 2 * (2 << 20)) as llm:
            outputs = llm.generate(prompts, params)
            stats = llm.cache.stats()
            assert llm.core.ledger.accounting() == llm.cache.accounting()
            return [o.outputs[0].logprobs for o in outputs], stats.unmaps, llm.core.scheduler.num_preemptions

    (sync, _, _), (overlapped, unmaps, preempted) = run(False), run(True)
    assert unmaps > 0 and preempted > 0, (unmaps, preempted)  # pages were reclaimed, requests preempted
    assert [len(o) for o in overlapped] == [len(o) for o in sync]
    # Random weights make many near-ties: where both took the same token its log-prob (which wrong K/V moves) agrees.
    pairs = [(a, b) for o, w in zip(overlapped, sync) for a, b in zip(o, w)]
    same = [(a, b) for a, b in pairs if a.token_id == b.token_id]
    assert len(same) >= 0.9 * len(pairs), f"only {len(same)} of {len(pairs)} tokens agree"
    assert max(abs(a.logprob - b.logprob) for a, b in same) < 0.1


@pytest.mark.parametrize(("attention", "dtype"), [("torch", "float32"), ("fa2", "bfloat16"), ("flash_attn", "bfloat16")])
def test_prefix_caching_on_cuda_vmm_gives_the_tokens_computed_without_it(attention, dtype):
    """Cached 2 MiB pages mapped into a second slot of real CUDA virtual memory. Three layers of 8 x 128 K/V heads:
    a token is 12 KiB in float32 (pages of 170 2/3 tokens: a split token's page is copied on the device), 6 KiB in
    bf16 (341 1/3); CUDA graphs and async scheduling on where the backend has them."""
    needs_attention(attention)
    config = replace(PRESETS["tiny"], hidden_size=1024, intermediate_size=2048, num_layers=3, num_heads=8,
                     num_kv_heads=8, head_dim=128)
    model = random_model(config, getattr(torch, dtype), "cuda")
    rng = random.Random(0)
    systems = [[rng.randrange(3, 500) for _ in range(rng.randint(350, 700))] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(16)]
    runs = {}
    for caching in (False, True):
        with LLM(model, enable_prefix_caching=caching, attention=attention, dtype=dtype, device="cuda",
                 max_num_seqs=8, max_model_len=1024, kv_memory=256 << 20) as llm:
            runs[caching] = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)] for _ in range(2)]
            assert (llm.scheduler.prefix_hits > 0) == caching
            assert (llm.core.ledger.prefix_pages_ahead > 0) == caching  # 8 running, 8 waiting: mapped ahead of them
            assert llm.core.ledger.accounting() == llm.cache.accounting()
    if dtype == "float32":
        assert runs[True] == runs[False]
    else:  # bf16: computing a prompt's end over cached K/V may round otherwise than over its own, and random
        # weights make near-ties; a sequence that takes the other side of one differs from there on (H100: 94.4% of
        # tokens the same with flash_attn; wrong K/V mapped in would agree on next to none).
        got, want = sum(runs[True], []), sum(runs[False], [])
        assert [g[0] for g in got] == [w[0] for w in want]
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        assert same >= 0.9 * sum(map(len, want)), f"only {same} of {sum(map(len, want))} tokens agree"


def heads_128_model(layers: int):
    """``layers`` layers of 8 x 128 K/V heads (FA3's and FlashInfer's head size), random bf16 weights, on the GPU."""
    config = replace(PRESETS["tiny"], hidden_size=1024, intermediate_size=2048, num_layers=layers, num_heads=8,
                     num_kv_heads=8, head_dim=128)
    return random_model(config, torch.bfloat16, "cuda")


def shared_prefix_prompts(rng: random.Random, systems: int, shortest: int, longest: int, suffix: int) -> list[list[int]]:
    """24 prompts: a cut (1 to ``longest`` tokens) of one of ``systems`` shared prompts of ``shortest``-``longest``
    tokens, then 1 to ``suffix`` of their own."""
    shared = [[rng.randrange(3, 500) for _ in range(rng.randint(shortest, longest))] for _ in range(systems)]
    return [rng.choice(shared)[: rng.randint(1, longest)] + [rng.randrange(3, 500) for _ in range(rng.randint(1, suffix))]
            for _ in range(24)]


def test_mixed_step_graphs_give_the_eager_steps_tokens():
    """FA3 mixed-step graphs (``mixed_graph_tokens``) against the same steps run eagerly: prompts chunked under a
    256-token budget beside running decodes, async scheduling (tokens filled in on the device), shared prefixes
    (cached pages under the chunks), a small pool. Each sequence's tokens agree up to where the eager run had a
    near-tie: the graphs' matmuls run padded shapes, whose bf16 sums round otherwise, so a 3-layer random model's flat
    logits flip a token now and then and the sequence goes its own way from there (on the H200 840 of 960 tokens
    agreed). A graph that read or wrote the wrong rows gives a token the eager run did not nearly pick."""
    needs_attention("fa3")
    model = heads_128_model(3)
    prompts = shared_prefix_prompts(random.Random(2), 3, 100, 300, 200)
    runs, used = {}, {}
    for tokens in (0, 2048):
        with LLM(model, attention="fa3", mixed_graph_tokens=tokens, dtype="bfloat16", device="cuda", max_num_seqs=8,
                 max_num_batched_tokens=256, max_model_len=768, kv_memory=48 << 20) as llm:
            assert llm.core.executor.worker.runner.graphs_captured  # when the engine started, before any request
            runs[tokens] = [o.outputs[0].logprobs for o in llm.generate(prompts, replace(GREEDY, logprobs=2))]
            torch.cuda.synchronize()
            assert llm.core.ledger.accounting() == llm.cache.accounting()
            mixed = llm.core.executor.worker.runner._mixed
            used[tokens] = None if mixed is None else sorted(mixed.graphs)
    assert used[0] is None and used[2048] == list(TOKEN_BUCKETS[:4])  # sizes up to the step budget, all captured
    assert [g[0].token_id for g in runs[2048]] == [w[0].token_id for w in runs[0]]
    flips = 0
    for got, want in zip(runs[2048], runs[0], strict=True):
        assert len(got) == len(want) == NEW_TOKENS
        for g, w in zip(got, want):
            assert abs(g.logprob - w.logprob) < 0.1 or g.token_id != w.token_id, (g, w)
            if g.token_id != w.token_id:  # the eager run's second choice, within a hair of its first
                assert g.token_id in w.top_logprobs and w.logprob - w.top_logprobs[g.token_id] < 0.05, (g, w)
                flips += 1
                break
    assert flips <= len(prompts) // 3, f"{flips} of {len(prompts)} sequences went another way"


@pytest.mark.parametrize(("layout", "attention", "graphs"), [
    ("mega", "fa2", True), ("mega", "flash_attn", True), ("per_layer", "flash_attn", False), ("mega", "flashinfer", True),
    ("mega", "fa3", True), ("per_layer", "fa3", False),
])
def test_kernels_read_nothing_past_a_256_token_guard_or_in_unbacked_space(layout, attention, graphs):
    """With the zero page only over 256 tokens past each slot's pages (``kv_guard_tokens``), or over nothing, no kernel
    read faults -- an illegal address would lose the CUDA context -- and every token is the one computed with the zero
    page everywhere. Eight layers of 8 x 128 K/V heads: 128 tokens a 2 MiB page, so the guard is two pages; random
    lengths end sequences at every offset of a page; shared prefixes and a pool a third of the demand (reclaim,
    eviction, preemption)."""
    needs_attention(attention)
    model = heads_128_model(8)
    prompts = shared_prefix_prompts(random.Random(1), 4, 200, 900, 300)
    runs = {}
    for backing in (dict(kv_guard_tokens=None), dict(kv_guard_tokens=256), dict(zero_unmapped=False)):
        with LLM(model, kv_layout=layout, attention=attention, cuda_graphs=graphs, dtype="bfloat16", device="cuda",
                 max_num_seqs=8, max_model_len=1400, kv_memory=96 << 20, **backing) as llm:
            runs[str(backing)] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
            torch.cuda.synchronize()
            assert llm.core.ledger.accounting() == llm.cache.accounting()
    first, *others = runs.values()
    assert all(run == first for run in others)


def test_penalties_on_the_gpu_count_the_token_in_flight(hf_llama128):
    """Presence, frequency and repetition penalties on the device, launched ahead or one step at a time: float32 with
    the reference attention against the CPU engine, and bf16 FA2 with CUDA-graph decode against itself. The counts
    include the token still on the device when the next step is launched. Batches differ in composition between the
    runs, so a near-tie may flip a token: the first of each prompt must match and nearly all the rest."""
    if cuda_missing():
        pytest.skip(cuda_missing())
    needs_attention("fa2")
    prompts = [list(range(5, 40)), list(range(100, 103)), [7, 8, 9, 10], list(range(270, 310))] * 2
    penalized = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, presence_penalty=1.0,
                               frequency_penalty=0.5, repetition_penalty=1.3)
    params = [penalized, replace(penalized, n=2), GREEDY, replace(penalized, repetition_penalty=1.0)] * 2

    def run(device: str, **kw) -> list[list[int]]:
        kw = {"attention": "torch", "dtype": "float32", **kw}
        with LLM(hf_llama128[0], device=device, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64, **kw) as llm:
            return [list(c.token_ids) for o in llm.generate(prompts, params) for c in o.outputs]

    def agree(got: list[list[int]], want: list[list[int]]) -> None:
        assert [t[0] for t in got] == [t[0] for t in want]
        pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
        agree = sum(a == b for a, b in pairs)
        assert agree >= 0.9 * len(pairs), f"only {agree} of {len(pairs)} agree"

    cpu = run("cpu")
    for overlap in (True, False):
        agree(run("cuda", async_scheduling=overlap), cpu)
    graphs = dict(attention="fa2", dtype="bfloat16", cuda_graphs=True)
    agree(run("cuda", async_scheduling=True, **graphs), run("cuda", async_scheduling=False, **graphs))


def test_prompt_logprobs_on_the_gpu_are_the_cpu_engines(hf_llama128):
    """Prompt logprobs read from the device in slices of the prompt's rows, launched ahead or one step at a time,
    across prefill chunks and a cached prefix (which they skip: nothing read twice): float32 with the reference
    attention gives the CPU engine's numbers, every prompt token and its top 3."""
    if cuda_missing():
        pytest.skip(cuda_missing())
    prompts = [list(range(5, 140)), list(range(100, 103)), list(range(5, 90)) + [7, 8, 9]]
    asks = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3)

    def run(device: str, **kw) -> list:
        with LLM(hf_llama128[0], device=device, attention="torch", dtype="float32", max_num_seqs=4, max_model_len=256,
                 max_num_batched_tokens=64, **kw) as llm:
            return [o.prompt_logprobs for o in llm.generate(prompts, asks)]

    cpu = run("cpu")
    for overlap in (True, False):
        for got, want in zip(run("cuda", async_scheduling=overlap), cpu, strict=True):
            assert got[0] is None and len(got) == len(want)
            for g, w in zip(got[1:], want[1:]):
                assert g.token_id == w.token_id and g.top_logprobs.keys() == w.top_logprobs.keys()
                assert g.logprob == pytest.approx(w.logprob, abs=1e-3)
