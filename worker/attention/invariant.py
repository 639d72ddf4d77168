"""Batch-invariant attention for ``deterministic=True``: a query's output is a function of its own sequence's
tokens up to its position alone -- not of the other sequences in the step, of how its prompt was chunked, of whether
its token was computed in a prefill or a decode step (a preempted sequence recomputes its decoded tokens in a
prefill), or of a CUDA graph.

The fast kernels are none of these: flash-attn splits a decode's KV over more blocks when the batch is small, and
prefill and decode are different kernels that sum in different orders.

- CUDA (``_attention_kernel``, Triton): one kernel for every step. A program takes a tile of ``TILE`` consecutive
  query tokens of one sequence and one KV head (its query heads side by side: ``TILE x GROUP`` rows) and walks that
  slot's keys from position 0 up in blocks of ``BLOCK_N`` with the online softmax, with no split: a decode step's
  tile holds one token, a prefill's up to ``TILE``, and every row sums the same blocks in the same order either
  way. A row whose causal window ends before its tile's last block only meets fully masked blocks there, which
  leave its sums as they are (scaled by exp(0) = 1, plus zeros).
- CPU: torch's SDPA one query at a time, over exactly the keys up to its position: the same call, of the same
  shape, wherever that query is computed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from worker import kernels
from worker.attention.metadata import AttentionMetadata
from worker.attention.reference import gathered
from worker.batch_invariant import precision
from worker.staging import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the per-query path
    triton = None

TILE_ROWS = 32  # query rows (tokens x a KV head's query heads) a program: the MMA's M, the same in every step
BLOCK_N = 64


class InvariantAttention:
    """The ``invariant`` backend: reads a virtual cache's slots in place on CUDA (CUDA graphs too), gathers rows
    on CPU."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.reads = "slots" if self.cuda else "rows"
        self._tiles: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not self.cuda:
            return _per_query(q, k_rows, v_rows, meta)
        group = q.shape[1] // k_rows.shape[1]
        tile = max(1, TILE_ROWS // triton.next_power_of_2(group))
        tile_seq, tile_q0 = self._tile_table(meta, tile)
        out = torch.empty_like(q)
        if len(tile_seq):
            attention(q, k_rows, v_rows, out, meta, tile_seq, tile_q0, tile)
        return out

    def _tile_table(self, meta: AttentionMetadata, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each tile's sequence (index into the step's sequences) and first query row. A decode step's tiles are
        its sequences, one token each, straight from the metadata (a CUDA graph's step lists no sequences on the
        host); a step with prefill chunks builds its table once, for all layers."""
        if meta.max_query_len == 1:
            first = meta.cu_seqlens_q[:-1]
            return first, first
        if self._tiles is None or self._tiles[0] is not meta:
            seqs, starts, row = [], [], 0
            for i, seq in enumerate(meta.seqs):
                for start in range(row, row + seq.query_len, tile):
                    seqs.append(i)
                    starts.append(start)
                row += seq.query_len
            table = to_device(torch.tensor([seqs, starts], dtype=torch.int32), meta.seqused_k.device)
            self._tiles = (meta, table[0], table[1])
        return self._tiles[1], self._tiles[2]


def _per_query(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    out = torch.empty_like(q)
    for q_at, seq, k, v in gathered(k_rows, v_rows, meta):
        for j in range(seq.query_len):
            seen = seq.kv_len - seq.query_len + j + 1  # the query at that position sees these keys, no mask
            o = F.scaled_dot_product_attention(q[q_at + j, :, None], k[:, :seen], v[:, :seen], enable_gqa=True)
            out[q_at + j] = o[:, 0]
    return out


def attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
              tile_seq: torch.Tensor, tile_q0: torch.Tensor, tile: int) -> None:
    """``out`` ``[tokens, H, D]`` = attention of ``q`` over the slots' rows of ``k_rows`` / ``v_rows`` ``[rows, Hkv, D]``,
    tile ``t`` covering up to ``tile`` query rows from ``tile_q0[t]`` of sequence ``tile_seq[t]``."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_rows.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    for name, t in (("q", q), ("k", k_rows), ("v", v_rows), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"invariant attention reads head dims side by side: {name}'s last stride must be 1")
    group = heads // kv_heads
    qk_scale = 1.0 / math.sqrt(dim) * 1.4426950408889634  # log2(e): the kernel's exponentials are exp2
    _attention_kernel[(len(tile_seq), kv_heads)](
        q, kernels.address(k_rows), kernels.address(v_rows), out, meta.seq_starts, meta.seqused_k, meta.cu_seqlens_q,
        tile_seq, tile_q0,
        q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
        out.stride(0), out.stride(1), qk_scale,
        GROUP=group, GROUP_P=triton.next_power_of_2(group), TILE=tile, DIM=dim, DIM_P=triton.next_power_of_2(dim),
        BLOCK_N=BLOCK_N, PRECISION=precision(q.dtype), num_warps=4, num_stages=2)


if triton is not None:

    # The per-step tables are read a word at a time, and where one starts depends on the step (a row of a packed
    # upload): specialising on their alignment compiled new kernels in the middle of a run (W1 on the H100).
    @triton.jit(do_not_specialize=["starts_ptr", "kv_lens_ptr", "cu_q_ptr", "tile_seq_ptr", "tile_q0_ptr"])
    def _attention_kernel(q_ptr, k_at, v_at, o_ptr, starts_ptr, kv_lens_ptr, cu_q_ptr, tile_seq_ptr, tile_q0_ptr,
                          stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_ot, stride_oh,
                          qk_scale, GROUP: tl.constexpr, GROUP_P: tl.constexpr, TILE: tl.constexpr,
                          DIM: tl.constexpr, DIM_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        k_ptr = k_at.to(tl.int64).to(tl.pointer_type(q_ptr.dtype.element_ty))  # the cache's rows: ``kernels.address``
        v_ptr = v_at.to(tl.int64).to(tl.pointer_type(q_ptr.dtype.element_ty))
        t = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + t)
        q0 = tl.load(tile_q0_ptr + t)
        q_end = tl.load(cu_q_ptr + seq + 1)
        kv_len = tl.load(kv_lens_ptr + seq)
        start = tl.load(starts_ptr + seq).to(tl.int64)  # the slot's first row: past 2**31 in a large cache
        rows = tl.arange(0, TILE * GROUP_P)
        tok = q0 + rows // GROUP_P
        head = kv_head * GROUP + rows % GROUP_P
        valid = (tok < q_end) & (rows % GROUP_P < GROUP)
        pos = kv_len - q_end + tok  # each row's position: it sees keys 0..pos
        dims = tl.arange(0, DIM_P)
        in_dim = dims < DIM
        q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=valid[:, None] & in_dim[None, :], other=0.0)
        m_i = tl.full((TILE * GROUP_P,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((TILE * GROUP_P,), dtype=tl.float32)
        acc = tl.zeros((TILE * GROUP_P, DIM_P), dtype=tl.float32)
        last = tl.minimum(kv_len, kv_len - q_end + q0 + TILE)  # one past the last key any row of the tile sees
        for n0 in range(0, last, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            present = keys < kv_len  # rows past the sequence are never read (they may be unmapped)
            key_rows = start + keys.to(tl.int64)
            k = tl.load(k_ptr + key_rows[None, :] * stride_kr + kv_head * stride_kh + dims[:, None],
                        mask=present[None, :] & in_dim[:, None], other=0.0)
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
            s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + key_rows[:, None] * stride_vr + kv_head * stride_vh + dims[None, :],
                        mask=present[:, None] & in_dim[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=valid[:, None] & in_dim[None, :])
