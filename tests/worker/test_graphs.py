"""CUDA-graph decode and mixed steps give the eager step's logits (GPU); the row buckets they and eager logits share;
a mixed step's padded inputs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvmem import KVCacheSpec, PagedKVCache, VirtualKVCache, paged_spec
from tests.conftest import cuda_missing, make_vmm, needs_attention
from worker.attention import get_backend
from worker.graphs import BATCH_BUCKETS, padded_rows
from worker.config import PRESETS
from worker.loader import build_model, random_model
from worker.mixed_graphs import TOKEN_BUCKETS, MixedGraphs, mixed_inputs, token_sizes
from worker.rope import rope_cache
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


def test_a_mixed_steps_inputs_pad_tokens_to_the_scratch_slot_and_sequences_to_nothing():
    chunks = (chunk(0, 3, [11, 12, 13], 5), chunk(1, 4, [21], 9), chunk(2, 6, [31, 32], 0))
    tokens, seqs = mixed_inputs(chunks, 8, 5, scratch=0)
    assert tokens.dtype == torch.long and tokens.tolist() == [
        [11, 12, 13, 21, 31, 32, 0, 0],  # ids
        [5, 6, 7, 9, 0, 1, 0, 0],  # positions: each chunk's from its start
        [3, 3, 3, 4, 6, 6, 0, 0],  # each token's slot; padding writes the scratch slot's first row
    ]
    assert seqs.dtype == torch.int32 and seqs.tolist() == [
        [0, 3, 4, 6, 6, 6],  # cu_seqlens_q: padding sequences hold no token, padding tokens belong to none
        [8, 10, 2, 0, 0, 0],  # KV lengths: a chunk's end
        [3, 4, 6, 0, 0, 0],
    ]
    with pytest.raises(ValueError, match="a mixed step of 6 tokens in 3 sequences does not fit 4 tokens in 5 sequences"):
        mixed_inputs(chunks, 4, 5, scratch=0)
    with pytest.raises(ValueError, match="does not fit 8 tokens in 2 sequences"):
        mixed_inputs(chunks, 8, 2, scratch=0)


def test_mixed_step_sizes_step_by_64_tokens_then_coarser_up_to_the_cap():
    assert token_sizes(2048) == list(TOKEN_BUCKETS)
    assert token_sizes(600) == [64, 128, 192, 256, 320, 384, 448, 512, 576, 600]
    assert token_sizes(3000) == [*TOKEN_BUCKETS, 2560, 3000]  # past 2048 by 512: a step of 2049 pads to 2560


def test_mixed_step_graphs_need_a_backend_that_runs_a_mixed_step_in_one_call():
    model = build_model("tiny", torch.float32, "cpu")
    spec = KVCacheSpec(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, torch.float32, 4, 64,
                       "mega", 4096)
    with VirtualKVCache(spec, 8 * spec.num_buffers * spec.page_size, make_vmm("host")) as cache:
        with pytest.raises(ValueError, match="mixed-step CUDA graphs need an attention backend that runs a mixed step "
                                             "in one call over a virtual cache \\(fa3\\), got ReferenceAttention"):
            MixedGraphs(model, cache, get_backend("torch"), rope_cache(model.config, "cpu"), 4, 256, 0)


@pytest.mark.gpu
def test_mixed_graph_replay_matches_the_eager_step():
    """Steps of decode rows beside a new prompt and a prompt's later chunk, replayed from FA3 mixed-step graphs of two
    sizes, against the same steps run eagerly, each on slots of its own: the same tokens and logprobs (near-ties
    aside), and then the same decode step read over the K/V each wrote (a graph that wrote them elsewhere fails it)."""
    needs_attention("fa3")
    config = replace(PRESETS["tiny"], hidden_size=1024, intermediate_size=2048, num_layers=3, num_heads=8,
                     num_kv_heads=8, head_dim=128)
    model = random_model(config, torch.bfloat16, "cuda")
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, torch.bfloat16, 16, 1024, "mega", 2 << 20)
    with VirtualKVCache(spec, 32 * spec.num_buffers * spec.page_size, make_vmm("cuda")) as cache:
        impl = get_backend("fa3", "cuda")
        eager = ModelRunner(model, cache, impl, "cuda")
        scratch = cache.alloc_slot()
        cache.ensure(scratch, 1)
        runners = {"eager": eager,
                   "graphs": ModelRunner(model, cache, impl, "cuda", graph_batch=6, scratch_slot=scratch, mixed_tokens=256)}
        slots = {path: [cache.alloc_slot() for _ in range(6)] for path in runners}
        for slot in sum(slots.values(), []):
            cache.ensure(slot, 400)
        gen = torch.Generator().manual_seed(0)

        def ids(n: int) -> list[int]:
            return torch.randint(0, 256, (n,), generator=gen).tolist()

        def plan(path: str, steps: list[tuple[int, list[int], int, int]]) -> StepPlan:
            """(sequence, its tokens, their start, draws): sequence i in slot i of the path's own."""
            return StepPlan(tuple(replace(chunk(seq, slots[path][seq], tokens, start), num_samples=draws)
                                  for seq, tokens, start, draws in steps))

        def both(steps, runner: str | None = None) -> dict:
            """The step on both paths' slots (by their own runner, or both by ``runner``): eager's logprobs, after
            checking the other path's against them."""
            want = runners[runner or "eager"].execute(plan("eager", steps)).logprobs
            got = runners[runner or "graphs"].execute(plan("graphs", steps)).logprobs
            assert set(got) == set(want) == {seq for seq, _, _, draws in steps if draws}
            for seq in want:
                w, g = want[seq][0], got[seq][0]
                assert g.token_id == w.token_id
                assert set(g.top_logprobs) == set(w.top_logprobs)
                assert all(abs(g.top_logprobs[t] - w.top_logprobs[t]) < 2e-2 for t in w.top_logprobs)
            return {seq: w[0].token_id for seq, w in want.items()}

        lengths, prompts = {0: 37, 1: 150, 2: 9}, {3: ids(40), 4: ids(120), 5: ids(150)}
        last = both([(seq, ids(n), 0, 1) for seq, n in lengths.items()], runner="eager")  # three decoding, same K/V
        both([(4, prompts[4][:70], 0, 0)], runner="eager")  # a prompt whose first chunk ran before
        # step 1: 3 decodes, a new prompt, the later chunk (93 tokens: the 128-token graph)
        steps = [(seq, [last[seq]], n, 1) for seq, n in lengths.items()]
        last |= both(steps + [(3, prompts[3], 0, 1), (4, prompts[4][70:], 70, 1)])
        # step 2: 5 decodes over what step 1 wrote, a new prompt (155 tokens: the 192-token graph)
        at = {**{seq: n + 1 for seq, n in lengths.items()}, 3: 40, 4: 120}
        last |= both([(seq, [last[seq]], at[seq], 1) for seq in at] + [(5, prompts[5], 0, 1)])
        # step 3, eager on both paths' slots: each reads the K/V its own path wrote in steps 1 and 2
        at = {seq: n + 1 for seq, n in at.items()} | {5: 150}
        both([(seq, [last[seq]], at[seq], 1) for seq in at], runner="eager")
        assert sorted(runners["graphs"]._mixed.graphs) == [64, 128, 192, 256]
