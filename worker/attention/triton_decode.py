"""Decode attention over the virtual cache in Triton: split-KV flash-decoding that reads each slot's rows where
they lie, every query head of a KV head served by one read of its K/V.

A decode step's attention only streams K/V from memory, so its floor is their bytes over the memory bandwidth.
flash-attn's split-KV kernel (FA2) reads them at ~2.8 TB/s on the H100 and vLLM's FA3 at ~2.9
(``docs/performance.md``); the virtual cache's contiguous rows let a plain kernel stream long runs of them.

Two launches: ``_split_kernel`` (grid: sequence x KV head x split) attends one KV head's ``GROUP`` query heads to
``split`` consecutive tokens and writes the partial output with its log-sum-exp; ``_combine_kernel`` (grid:
sequence x query head) merges a sequence's splits. The split length is fixed by the slot length alone
(``split_tokens``), never by the batch, so a sequence's result does not depend on what else is in the step,
and the grid is the same for every step of a CUDA-graph bucket.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the backends that use this need CUDA anyway
    triton = None

MIN_SPLIT = 256  # tokens a split at least: shorter ones cost more in partials than they gain in parallelism
MAX_SPLITS = 16
BLOCK_N = 64  # tokens a loop iteration


def split_tokens(slot_tokens: int) -> int:
    """Tokens per split for slots of ``slot_tokens`` rows: at least ``MIN_SPLIT``, at most ``MAX_SPLITS`` splits
    a slot, a multiple of ``BLOCK_N``."""
    split = max(MIN_SPLIT, -(-slot_tokens // MAX_SPLITS))
    return -(-split // BLOCK_N) * BLOCK_N


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     slots: torch.Tensor, max_len: int | None = None, *, block_n: int = BLOCK_N,
                     split: int | None = None, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """``q`` ``[B, Hq, D]`` (one query per sequence) against ``k_cache`` / ``v_cache`` ``[slots, tokens, Hkv, D]``
    (any strides but the last): sequence ``i`` attends to the first ``lengths[i]`` rows of slot ``slots[i]``.
    ``max_len`` bounds the lengths (default: the slot length; a CUDA graph needs the default, its grid fixed).
    Returns ``[B, Hq, D]`` in q's dtype."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention reads head dims side by side: the last stride must be 1")
    slot_tokens = k_cache.shape[1]
    split = split or split_tokens(slot_tokens)
    splits = -(-(max_len or slot_tokens) // split)
    group = heads // kv_heads
    partial = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, lengths, slots, partial, lse,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        (1.0 / math.sqrt(dim)) * 1.4426950408889634,  # softmax scale, in base 2
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, SPLIT=split, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )
    _combine_kernel[(batch, heads)](
        partial, lse, lengths, out, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), D=dim, SPLIT=split, num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, slots_ptr, o_ptr, lse_ptr,
                      stride_qb, stride_qh, stride_ks, stride_kt, stride_kh, stride_vs, stride_vt, stride_vh,
                      stride_ob, stride_oh, stride_os, stride_lb, stride_lh, scale,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        n = tl.load(lens_ptr + b)
        start = s * SPLIT
        if start < n:
            end = tl.minimum(start + SPLIT, n)
            slot = tl.load(slots_ptr + b).to(tl.int64)  # slot * stride passes 2**31 in a large cache
            g = tl.arange(0, GROUP_PAD)
            d = tl.arange(0, D)
            heads = kvh * GROUP + g
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                        mask=(g < GROUP)[:, None], other=0.0)
            k_base = k_ptr + slot * stride_ks + kvh * stride_kh
            v_base = v_ptr + slot * stride_vs + kvh * stride_vh
            m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            l = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, D], tl.float32)
            for t0 in range(start, end, BLOCK_N):
                t = t0 + tl.arange(0, BLOCK_N)
                inside = t < end
                rows = t.to(tl.int64)[:, None]
                k = tl.load(k_base + rows * stride_kt + d[None, :], mask=inside[:, None], other=0.0)
                scores = tl.dot(q, tl.trans(k)) * scale
                scores = tl.where(inside[None, :], scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, 1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(scores - m_new[:, None])
                l = l * alpha + tl.sum(p, 1)
                v = tl.load(v_base + rows * stride_vt + d[None, :], mask=inside[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
            live = g < GROUP
            o = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + s * stride_os + d[None, :]
            tl.store(o, acc / l[:, None], mask=live[:, None])
            tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + s, m + tl.log2(l), mask=live)

    @triton.jit
    def _combine_kernel(o_ptr, lse_ptr, lens_ptr, out_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                        stride_outb, stride_outh, D: tl.constexpr, SPLIT: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        splits = tl.cdiv(tl.load(lens_ptr + b), SPLIT)
        d = tl.arange(0, D)
        m = float("-inf")
        total = 0.0
        acc = tl.zeros([D], tl.float32)
        for s in range(0, splits):
            lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s)
            o = tl.load(o_ptr + b * stride_ob + h * stride_oh + s * stride_os + d)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + o * w
            total = total * alpha + w
            m = m_new
        tl.store(out_ptr + b * stride_outb + h * stride_outh + d, (acc / total).to(out_ptr.dtype.element_ty))
