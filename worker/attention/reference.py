"""The pure-torch attention backend: gathers each sequence's K/V rows and runs SDPA. Any device, any
dtype, any cache (virtual rows or paged block rows): the reference the fast backends are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.metadata import AttentionMetadata


class ReferenceAttention:
    name = "torch"
    gathers = True

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
        for i, seq in enumerate(meta.seqs):
            rows = meta.kv_rows[cu_k[i] : cu_k[i + 1]]
            qs = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)  # [H, n, D]
            k, v = k_rows[rows].transpose(0, 1), v_rows[rows].transpose(0, 1)  # [Hkv, L, D]
            # Query j sits at position kv_len - query_len + j and sees every key up to it.
            offset = seq.kv_len - seq.query_len
            mask = torch.arange(seq.kv_len, device=q.device)[None, :] <= torch.arange(seq.query_len, device=q.device)[:, None] + offset
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
            out[cu_q[i] : cu_q[i + 1]] = o.transpose(0, 1)
        return out
