"""Tensor parallelism over torch.distributed (gloo, two CPU processes): the sharded model -- heads and MLP
split, partial sums all-reduced, each rank caching only its KV heads, the LM head split by vocabulary where it
divides -- gives the unsharded logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from kvmem import KVCacheSpec, VirtualKVCache
from worker.attention import get_backend
from worker.loader import build_model
from worker.parallel import TPGroup
from worker.runner import ModelRunner, ScheduledChunk, StepPlan
from worker.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 120]
LOGPROBS = SamplingParams(max_tokens=1, temperature=0, logprobs=5)


def step_logprobs(path: str, tp: TPGroup) -> list[dict[int, float]]:
    """Prefill PROMPT, then decode one token; the top-5 logprobs of both steps."""
    model = build_model(path, torch.float32, tp=tp)
    c = model.config
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads // tp.size, c.head_dim, torch.float32, 2, 64, "mega", 4096)
    with VirtualKVCache(spec, 16 * 4096) as cache:
        runner = ModelRunner(model, cache, get_backend("torch"), "cpu")
        slot = cache.alloc_slot()
        cache.ensure(slot, len(PROMPT) + 1)
        first = runner.execute(StepPlan((ScheduledChunk(1, slot, tuple(PROMPT), 0, 1, LOGPROBS, 0, 0),)))
        (token,) = first.sampled[1]
        second = runner.execute(StepPlan((ScheduledChunk(1, slot, (token,), len(PROMPT), 1, LOGPROBS, 0, 1),)))
        return [first.logprobs[1][0].top_logprobs, second.logprobs[1][0].top_logprobs]


def greedy_tokens(path: str, tp: TPGroup, samples: bool = True) -> tuple[list[int], int]:
    """Prefill PROMPT and decode 6 greedy tokens (no logprobs: split LM heads exchange each rank's best token only);
    and the LM head's rows on this rank. ``samples``: the runner's (a rank whose peer samples: False)."""
    model = build_model(path, torch.float32, tp=tp)
    c = model.config
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads // tp.size, c.head_dim, torch.float32, 2, 64, "mega", 4096)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    with VirtualKVCache(spec, 16 * 4096) as cache:
        runner = ModelRunner(model, cache, get_backend("torch"), "cpu", samples=samples)
        slot = cache.alloc_slot()
        cache.ensure(slot, len(PROMPT) + 8)
        tokens, chunk = [], ScheduledChunk(1, slot, tuple(PROMPT), 0, 1, greedy, 0, 0)
        for k in range(7):
            (token,) = runner.execute(StepPlan((chunk,))).sampled[1]
            tokens.append(token)
            chunk = ScheduledChunk(1, slot, (token,), len(PROMPT) + k, 1, greedy, 0, k + 1)
        return tokens, model.output.weight.shape[0]


def _greedy_rank(rank: int, size: int, init: str, path: str, out: str, samples: bool) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        torch.save(greedy_tokens(path, TPGroup(rank, size), samples or rank == 0), f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("vocab, split", [(320, True), (321, False), (320, False)])
def test_two_ranks_draw_the_single_ranks_greedy_tokens_with_the_lm_head_split_where_the_vocabulary_divides(
        tmp_path, monkeypatch, vocab, split):
    # 320: each rank holds 160 rows of the LM head and the ranks exchange their best token a row; rank 1 is built as
    # a rank whose peer samples (samples=False), and samples all the same: the exchange needs both. 321: whole heads,
    # each rank sampling on its own (here both, so that each has its tokens to feed back); and whole heads at 320 where
    # ``VATTN_SPLIT_LM_HEAD=0`` asks for them.
    if vocab % 2 == 0 and not split:
        monkeypatch.setenv("VATTN_SPLIT_LM_HEAD", "0")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    expected, rows = greedy_tokens(str(tmp_path / "model"), TPGroup())
    assert rows == vocab
    out = str(tmp_path / "tokens")
    mp.spawn(_greedy_rank, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path / "model"), out, not split),
             nprocs=2, join=True)
    for rank in range(2):
        tokens, rows = torch.load(f"{out}.{rank}")
        assert rows == (vocab // 2 if split else vocab)
        assert tokens == expected


def _columns_rank(rank: int, size: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        whole = torch.tensor([[1.0, 5.0, 2.0, 5.0, 0.0, 5.0],  # a tie within rank 0's slice and across ranks
                              [0.0, 1.0, 2.0, 3.0, 7.0, 7.0],  # the best in rank 2's slice, tied within it
                              [4.0, 0.0, 0.0, 4.0, 0.0, 4.0],  # tied in every slice
                              [-3.0, -2.0, -1.0, -9.0, -9.0, -9.0]]).to(torch.bfloat16)
        tp = TPGroup(rank, size)
        part = whole.chunk(size, dim=-1)[rank]
        torch.save((tp.gather_columns(part), tp.argmax_columns(part)), f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_split_rows_gather_whole_and_their_argmax_is_the_whole_rows_first_best(tmp_path):
    out = str(tmp_path / "columns")
    mp.spawn(_columns_rank, args=(3, f"file://{tmp_path}/rendezvous", out), nprocs=3, join=True)
    for rank in range(3):
        whole, best = torch.load(f"{out}.{rank}")
        assert whole.dtype == torch.bfloat16 and whole[:, 4].tolist() == [0.0, 7.0, 0.0, -9.0]
        assert best.tolist() == whole.argmax(-1).tolist() == [1, 4, 0, 2]


def _rank(rank: int, size: int, init: str, path: str, out: str, overlap_rows: int = 0) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        result = step_logprobs(path, TPGroup(rank, size, overlap_rows=overlap_rows))
        torch.save(result, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("overlap_rows", [0, 4])
def test_two_ranks_give_the_single_rank_logits(tmp_path, overlap_rows):
    # overlap_rows=4: the prompt's 9-row products in halves, each half's sum started before the next half's product
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    expected = step_logprobs(str(tmp_path / "model"), TPGroup())
    out = str(tmp_path / "logprobs")
    mp.spawn(_rank, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path / "model"), out, overlap_rows), nprocs=2,
             join=True)
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        for want, have in zip(expected, got):
            assert list(have) == list(want)  # same top tokens in the same order
            assert all(abs(have[t] - want[t]) < 1e-4 for t in want)


def test_tp_size_must_divide_heads():
    with pytest.raises(ValueError, match="num_heads=4 does not split over TP size 3"):
        build_model("tiny", torch.float32, tp=TPGroup(0, 3))


def _partial(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s partial sums: magnitudes far apart, so the order they are added in shows in the result."""
    gen = torch.Generator().manual_seed(1000 * numel + rank)
    return torch.randn(numel, generator=gen) * 10.0 ** (3 * (rank % 3))


def _ordered_rank(rank: int, size: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        tp = TPGroup(rank, size, ordered=True)
        torch.save({(n, dtype): tp.all_reduce(_partial(rank, n).to(dtype)) for n in (1, 7, 1000, 65537)
                    for dtype in (torch.float32, torch.bfloat16)}, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_the_ordered_all_reduce_adds_the_ranks_partials_in_rank_order_at_every_size(tmp_path):
    """``deterministic=True`` with more than two ranks: each element is (p0 + p1) + p2 on every rank, whatever the
    tensor's size (a ring or tree all-reduce starts an element's sum at a rank that depends on its chunk), in float32
    and rounded once, as the peer-memory kernel adds the sums that fit in it (a row's bits must not depend on whether
    its batch's sum did)."""
    out = str(tmp_path / "sums")
    mp.spawn(_ordered_rank, args=(3, f"file://{tmp_path}/rendezvous", out), nprocs=3, join=True)
    for rank in range(3):
        got = torch.load(f"{out}.{rank}")
        for (n, dtype), total in got.items():
            want = _partial(0, n).to(dtype).float()
            for r in range(1, 3):
                want = want + _partial(r, n).to(dtype).float()
            assert total.dtype == dtype and torch.equal(total, want.to(dtype)), (rank, n, dtype)
        # rounded after each add, bfloat16's sums would differ: the check above can tell the two apart
        rounded = (_partial(0, 65537).bfloat16() + _partial(1, 65537).bfloat16()) + _partial(2, 65537).bfloat16()
        assert not torch.equal(got[65537, torch.bfloat16], rounded)
