"""The whole engine on the GPU: FA2 (torch's, and flash-attn's where installed) over the virtual cache with
CUDA-graph decode, and the paged cache through the gather path and through flash-attn's block tables, against the eager reference attention on the same weights (bf16, so a near-tie may flip a token:
the first token of every prompt must match and nearly all the rest)."""

from __future__ import annotations

import pytest

from cluster.engine import LLM
from tests.cluster.conftest import NEW_TOKENS
from tests.conftest import cuda_missing
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
    if cuda_missing():
        pytest.skip(cuda_missing())
    if attention.startswith("flash_attn"):
        pytest.importorskip("flash_attn")
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
