"""The pure-torch attention backend: gathers each sequence's K/V rows and runs SDPA. Any device, any
dtype, any cache (virtual rows or paged block rows): the reference the fast backends are checked against."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from worker.attention.metadata import AttentionMetadata, SeqAttention


class ReferenceAttention:
    reads = "rows"

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        for q_at, seq, k, v in gathered(k_rows, v_rows, meta):
            qs = q[q_at : q_at + seq.query_len].transpose(0, 1)  # [H, n, D]
            # Query j sits at position kv_len - query_len + j and sees every key up to it.
            offset = seq.kv_len - seq.query_len
            mask = torch.arange(seq.kv_len, device=q.device)[None, :] <= torch.arange(seq.query_len, device=q.device)[:, None] + offset
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
            out[q_at : q_at + seq.query_len] = o.transpose(0, 1)
        return out


def gathered(k_rows: torch.Tensor, v_rows: torch.Tensor,
             meta: AttentionMetadata) -> Iterator[tuple[int, SeqAttention, torch.Tensor, torch.Tensor]]:
    """For each sequence of the step: its first query row, its part of the step, and its keys and values gathered
    from its rows, ``[Hkv, kv_len, D]`` each."""
    q_at = k_at = 0  # offsets from the host-side seqs: reading cu_seqlens would sync a GPU every layer
    for seq in meta.seqs:
        rows = meta.kv_rows[k_at : k_at + seq.kv_len]
        # index_select, not k_rows[rows]: on a CPU, indexing a strided view (one layer's rows of the mega layout)
        # copied the whole view first -- 2.4 ms against 7 us for 128 rows of a 33 MB view (torch 2.13).
        yield q_at, seq, k_rows.index_select(0, rows).transpose(0, 1), v_rows.index_select(0, rows).transpose(0, 1)
        q_at, k_at = q_at + seq.query_len, k_at + seq.kv_len
