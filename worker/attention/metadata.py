"""AttentionMetadata: where one step's tokens come from and go to in the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqAttention:
    """One sequence's part of a step: ``query_len`` new tokens ending at ``kv_len`` tokens in ``slot``."""

    slot: int
    query_len: int
    kv_len: int


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step, shared by every layer. Rows index the cache's ``rows(layer)`` tensors."""

    seqs: tuple[SeqAttention, ...]
    write_rows: torch.Tensor  # [tokens] long: the row each new token's K/V goes to
    kv_rows: torch.Tensor  # [sum kv_len] long: each sequence's rows in token order (gather backends)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: offsets into kv_rows
    seq_starts: torch.Tensor  # [B + 1] int32: first row of each sequence's slot (contiguous backends)
    seqused_k: torch.Tensor  # [B] int32
    max_query_len: int
    max_kv_len: int

    @classmethod
    def build(cls, seqs: list[SeqAttention], cache, device: torch.device) -> "AttentionMetadata":
        """From the step's sequences and the cache that holds them (``token_rows`` per slot)."""
        kv_rows = [cache.token_rows(s.slot, 0, s.kv_len) for s in seqs]
        write_rows = [rows[s.kv_len - s.query_len :] for rows, s in zip(kv_rows, seqs)]
        q_lens = torch.tensor([0] + [s.query_len for s in seqs])
        k_lens = torch.tensor([0] + [s.kv_len for s in seqs])
        starts = [int(rows[0]) if len(rows) else 0 for rows in kv_rows]
        as_int = dict(dtype=torch.int32, device=device)
        return cls(
            seqs=tuple(seqs),
            write_rows=torch.cat(write_rows).to(device),
            kv_rows=torch.cat(kv_rows).to(device),
            cu_seqlens_q=q_lens.cumsum(0).to(**as_int),
            cu_seqlens_k=k_lens.cumsum(0).to(**as_int),
            seq_starts=torch.tensor(starts + [starts[-1] + max(s.kv_len for s in seqs)]).to(**as_int),
            seqused_k=k_lens[1:].to(**as_int),
            max_query_len=max(s.query_len for s in seqs),
            max_kv_len=max(s.kv_len for s in seqs),
        )
