"""FlashAttention-2 as built into torch, straight over the virtual cache's contiguous slot rows."""

from __future__ import annotations

import torch

from worker.attention.metadata import AttentionMetadata


class FA2Attention:
    """``aten::_flash_attention_forward`` with ``cum_seq_k`` = each slot's first row and ``seqused_k`` =
    its length: the kernel reads the virtual cache in place (causal varlen for prefill, chunks that attend
    to a cached prefix, and decode)."""

    name = "fa2"
    gathers = False

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.max_query_len == 1 and q.shape[1] > k_rows.shape[1]:
            return self._decode_packed(q, k_rows, v_rows, meta)
        out = torch.ops.aten._flash_attention_forward(
            q, k_rows, v_rows, meta.cu_seqlens_q, meta.seq_starts, meta.max_query_len, meta.max_kv_len,
            0.0, True, False, seqused_k=meta.seqused_k,
        )
        return out[0]

    @staticmethod
    def _decode_packed(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode with GQA: the query heads that share a KV head become the rows of one query tile (all at
        the same position, so no causal mask), and each KV head's cache is read once instead of once per
        query head."""
        tokens, q_heads, dim = q.shape
        kv_heads = k_rows.shape[1]
        group = q_heads // kv_heads
        packed = q.view(tokens, kv_heads, group, dim).transpose(1, 2).reshape(tokens * group, kv_heads, dim)
        out = torch.ops.aten._flash_attention_forward(
            packed, k_rows, v_rows, meta.cu_seqlens_q * group, meta.seq_starts, group, meta.max_kv_len,
            0.0, False, False, seqused_k=meta.seqused_k,
        )[0]
        return out.view(tokens, group, kv_heads, dim).transpose(1, 2).reshape(tokens, q_heads, dim)


class PagedGatherFA2:
    """The paged baseline on CUDA: gather each sequence's blocks into one contiguous K/V, then FA2 varlen
    (no block-table argument in torch's FA2; GPU.md measures this at ~3x the in-place read)."""

    name = "paged"
    gathers = True

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k, v = k_rows[meta.kv_rows], v_rows[meta.kv_rows]
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_query_len, meta.max_kv_len, 0.0, True, False,
        )
        return out[0]
