"""The kernels of ``deterministic=True``: a row's result does not depend on the batch around it, bit for bit.

- ``worker.batch_invariant.linear``: a row alone, and at any place among 1 to 299 others (row counts that take
  each of the CUDA kernel's tilings).
- The ``invariant`` attention: a query's output is the same computed in a whole prefill, in a prefill chunk of any
  size, in a decode step, alone or beside other sequences' prefills and decodes.

CPU runs the blocked library product and the query-at-a-time attention; ``-m gpu`` the Triton kernels (which also
agree with the library product and the reference attention within rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmem import KVCacheSpec, VirtualKVCache
from tests.conftest import BACKENDS, cuda_missing, make_vmm
from worker.attention import AttentionMetadata, SeqAttention, get_backend
from worker.batch_invariant import linear


@pytest.fixture(params=BACKENDS)
def device(request) -> str:
    if request.param == "cuda" and cuda_missing():
        pytest.skip(cuda_missing())
    return "cpu" if request.param == "host" else "cuda"


@pytest.mark.parametrize(("n", "k", "bias"), [(4096, 1024, False), (1000, 333, True), (96, 64, False)])
def test_a_rows_product_is_the_same_alone_and_anywhere_in_any_batch(device, n, k, bias):
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        weight = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
        row = torch.randn(1, k, generator=gen).to(device=device, dtype=dtype)
        alone = linear(row, weight, b)
        for m in (2, 7, 16, 17, 129, 300):
            batch = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
            for at in {0, m // 2, m - 1}:
                batch[at] = row[0]
                assert torch.equal(linear(batch, weight, b)[at], alone[0]), (dtype, m, at)
        want = F.linear(row.double(), weight.double(), b.double() if bias else None)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        assert float((alone.double() - want).norm() / want.norm()) < tolerance


TARGET = 300  # the sequence followed: its tokens' outputs are compared


def attend(cache, seqs: list[SeqAttention], q: torch.Tensor, device: str) -> torch.Tensor:
    impl = get_backend("invariant", device)
    meta = AttentionMetadata.build(seqs, cache, torch.device(device), impl.reads)
    k_rows, v_rows = cache.rows(1)
    return impl.forward(q, k_rows, v_rows, meta)


# (query heads, KV heads, head dim): Llama 3's group of 4, and a group of 7 with a head of 80 (padded in the kernel)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (14, 2, 80)])
def test_a_querys_attention_is_the_same_in_a_prefill_a_chunk_or_a_decode_alone_or_in_a_batch(device, heads, kv_heads, dim):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    page = 64 << 10 if device == "cpu" else 2 << 20
    spec = KVCacheSpec(2, kv_heads, dim, dtype, 6, 1024, "mega", page)
    cache = VirtualKVCache(spec, 6 * spec.physical_bytes_for(1024), make_vmm("host" if device == "cpu" else "cuda"))
    gen = torch.Generator().manual_seed(0)
    others = {n: cache.alloc_slot() for n in (37, 513, 5, 129, 200)}  # length -> slot
    target = cache.alloc_slot()
    for n, slot in [*others.items(), (TARGET, target)]:
        cache.ensure(slot, n)
        kv = [torch.randn(n, kv_heads, dim, generator=gen).to(device=device, dtype=dtype) for _ in range(2)]
        cache.write(1, slot, 0, *kv)
    q_target = torch.randn(TARGET, heads, dim, generator=gen).to(device=device, dtype=dtype)

    def target_rows(first: int, last: int, beside: list[tuple[int, int]]) -> torch.Tensor:
        """The target's queries ``first..last-1`` (as a chunk ending at ``last``) beside other sequences' steps
        of (query_len, kv_len)."""
        seqs = [SeqAttention(others[kl], ql, kl) for ql, kl in beside]
        seqs.insert(len(seqs) // 2, SeqAttention(target, last - first, last))
        q_others = [torch.randn(s.query_len, heads, dim, generator=gen).to(device=device, dtype=dtype) for s in seqs]
        at = seqs.index(SeqAttention(target, last - first, last))
        q_others[at] = q_target[first:last]
        out = attend(cache, seqs, torch.cat(q_others), device)
        start = sum(s.query_len for s in seqs[:at])
        return out[start : start + last - first]

    whole = target_rows(0, TARGET, [])
    prefills, decodes = [(37, 37), (100, 200)], [(1, 513), (1, 5), (1, 129)]
    assert torch.equal(target_rows(0, TARGET, prefills + decodes), whole)
    for size in (1, 7, 64, 100):  # chunked prefill: every chunk's rows as in the whole prefill
        for first in range(0, TARGET, size if size > 7 else 97):
            last = min(first + size, TARGET)
            assert torch.equal(target_rows(first, last, decodes), whole[first:last]), (size, first)
    for position in (0, 63, 64, 65, TARGET - 1):  # decode steps, alone and among others
        assert torch.equal(target_rows(position, position + 1, []), whole[position : position + 1])
        assert torch.equal(target_rows(position, position + 1, decodes), whole[position : position + 1])
    reference = get_backend("torch", device)
    meta = AttentionMetadata.build([SeqAttention(target, TARGET, TARGET)], cache, torch.device(device), "rows")
    want = reference.forward(q_target, *cache.rows(1), meta).float()
    assert float((whole.float() - want).norm() / want.norm()) < (1e-5 if device == "cpu" else 1e-2)
    cache.close()
