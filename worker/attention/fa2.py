"""FlashAttention-2 as built into torch, straight over the virtual cache's contiguous slot rows."""

from __future__ import annotations

import torch

from worker.attention.metadata import AttentionMetadata


class FA2Attention:
    """``aten::_flash_attention_forward`` with ``cum_seq_k`` = each slot's first row and ``seqused_k`` =
    its length: the kernel reads the virtual cache in place (causal varlen for prefill, chunks that attend
    to a cached prefix, and decode)."""

    reads = "slots"

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.ops.aten._flash_attention_forward(
            q, k_rows, v_rows, meta.cu_seqlens_q, meta.seq_starts, meta.max_query_len, meta.max_kv_len,
            0.0, True, False, seqused_k=meta.seqused_k,
        )
        return out[0]


class PagedGatherFA2:
    """The paged baseline on CUDA: gather each sequence's blocks into one contiguous K/V, then FA2 varlen
    (no block-table argument in torch's FA2; GPU.md measures this at ~3x the in-place read)."""

    reads = "rows"

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k, v = k_rows.index_select(0, meta.kv_rows), v_rows.index_select(0, meta.kv_rows)  # as reference.gathered
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_query_len, meta.max_kv_len, 0.0, True, False,
        )
        return out[0]
