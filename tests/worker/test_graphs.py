"""CUDA-graph decode steps give the eager step's logits (GPU); the row buckets they and eager logits share."""

from __future__ import annotations

import pytest
import torch

from kvmem import KVCacheSpec, PagedKVCache, VirtualKVCache, paged_spec
from tests.conftest import cuda_missing, make_vmm
from worker.attention import get_backend
from worker.graphs import BATCH_BUCKETS, padded_rows
from worker.loader import build_model
from worker.runner import ModelRunner, ScheduledChunk, StepPlan
from worker.sampling import SamplingParams

TOP = SamplingParams(max_tokens=1, temperature=0, logprobs=5)


def chunk(seq: int, slot: int, tokens: list[int], start: int) -> ScheduledChunk:
    return ScheduledChunk(seq, slot, tuple(tokens), start, 1, TOP, 0, 0)


def make_cache(backend: str, c):
    if backend == "flash_attn_paged":  # blocks of 256 tokens: a sequence past 256 spans two, not adjacent
        spec = paged_spec(c.num_layers, c.num_kv_heads, c.head_dim, 256, dtype=torch.bfloat16, max_slots=8, max_tokens=512)
        return PagedKVCache(spec, 16 * spec.page_size * spec.bytes_per_token, "cuda")
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, torch.bfloat16, 8, 512, "mega", 2 << 20)
    return VirtualKVCache(spec, 16 * spec.num_buffers * spec.page_size, make_vmm("cuda"))


@pytest.mark.parametrize(("rows", "padded"), [(1, 1), (3, 4), (8, 8), (33, 48), (97, 128), (256, 256), (257, 384), (1000, 1024)])
def test_padded_rows(rows, padded):
    assert padded_rows(rows) == padded
    assert padded in BATCH_BUCKETS or padded % 128 == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fa2", "flash_attn", "flash_attn_paged"])
@pytest.mark.parametrize("batch", [3, 5])
def test_graph_replay_matches_eager_logits(batch, backend):
    if cuda_missing():
        pytest.skip(cuda_missing())
    if backend.startswith("flash_attn"):
        pytest.importorskip("flash_attn")
    model = build_model("tiny", torch.bfloat16, "cuda")
    with make_cache(backend, model.config) as cache:
        impl = get_backend(backend, "cuda")
        eager = ModelRunner(model, cache, impl, "cuda")
        scratch = cache.alloc_slot()
        cache.ensure(scratch, 1)
        graphs = ModelRunner(model, cache, impl, "cuda", graph_batch=6, scratch_slot=scratch)
        gen = torch.Generator().manual_seed(batch)
        # lengths up to 255 + 7: the paged case's longest sequences cross into a second block during decode
        slots, lengths = [cache.alloc_slot() for _ in range(batch)], [7 + 62 * i for i in range(batch)]
        last = {}
        for seq, (slot, n) in enumerate(zip(slots, lengths)):
            cache.ensure(slot, n + 2)
            prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
            last[seq] = eager.execute(StepPlan((chunk(seq, slot, prompt, 0),))).sampled[seq][0]
        for step in range(2):  # two replays with different inputs
            plan = StepPlan(tuple(chunk(seq, slot, [last[seq]], n + step) for seq, (slot, n) in enumerate(zip(slots, lengths))))
            want = eager.execute(plan).logprobs
            got = graphs.execute(plan).logprobs
            for seq in range(batch):
                w, g = want[seq][0], got[seq][0]
                assert g.token_id == w.token_id
                # the same top tokens with the same logprobs; near-ties may swap places (the padded batch's
                # matmuls round differently)
                assert set(g.top_logprobs) == set(w.top_logprobs)
                assert all(abs(g.top_logprobs[t] - w.top_logprobs[t]) < 2e-2 for t in w.top_logprobs)
                last[seq] = w.token_id
