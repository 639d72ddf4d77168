"""AttentionMetadata: where one step's tokens come from and go to in the KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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
    kv_rows: torch.Tensor | None  # [sum kv_len] long: each sequence's rows in token order (gather backends only)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: offsets into kv_rows
    seq_starts: torch.Tensor  # [B + 1] int32: first row of each sequence's slot (contiguous backends)
    seqused_k: torch.Tensor  # [B] int32
    slots: torch.Tensor  # [B] int32: each sequence's cache slot (``cache_batch_idx`` of flash_attn)
    slot_tokens: int  # rows per slot: ``rows(layer).unflatten(0, (-1, slot_tokens))`` is [slot, token, H, D]
    max_query_len: int
    max_kv_len: int

    @classmethod
    def build(cls, seqs: list[SeqAttention], cache, device: torch.device, gather: bool) -> "AttentionMetadata":
        """From the step's sequences and the cache that holds them. ``gather``: also list every KV row of
        every sequence (backends that gather; contiguous ones read ``seq_starts`` + ``seqused_k``)."""
        if gather:
            kv_rows = [cache.token_rows(s.slot, 0, s.kv_len) for s in seqs]
            write_rows = [rows[s.kv_len - s.query_len :] for rows, s in zip(kv_rows, seqs)]
        else:
            write_rows = [cache.token_rows(s.slot, s.kv_len - s.query_len, s.kv_len) for s in seqs]
        q_lens = torch.tensor([0] + [s.query_len for s in seqs])
        k_lens = torch.tensor([0] + [s.kv_len for s in seqs])
        starts = [int(rows[0]) - (s.kv_len - s.query_len) for rows, s in zip(write_rows, seqs)]
        as_int = dict(dtype=torch.int32, device=device)
        return cls(
            seqs=tuple(seqs),
            write_rows=torch.cat(write_rows).to(device),
            kv_rows=torch.cat(kv_rows).to(device) if gather else None,
            cu_seqlens_q=q_lens.cumsum(0).to(**as_int),
            cu_seqlens_k=k_lens.cumsum(0).to(**as_int),
            seq_starts=torch.tensor(starts + [starts[-1] + max(s.kv_len for s in seqs)]).to(**as_int),
            seqused_k=k_lens[1:].to(**as_int),
            slots=torch.tensor([s.slot for s in seqs]).to(**as_int),
            slot_tokens=cache.spec.slot_tokens,
            max_query_len=max(s.query_len for s in seqs),
            max_kv_len=max(s.kv_len for s in seqs),
        )

    @cached_property
    def decode_split(self) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int, int], ...]]:
        """For backends that batch one-query sequences apart from prefill chunks: the decode sequences'
        query rows and indices (device tensors), and each prefill chunk's (index, first row, end row).
        Worked out on first use and kept: every layer of the step shares this metadata."""
        rows, seqs, prefills, row = [], [], [], 0
        for i, seq in enumerate(self.seqs):
            if seq.query_len == 1:
                rows.append(row)
                seqs.append(i)
            else:
                prefills.append((i, row, row + seq.query_len))
            row += seq.query_len
        as_long = dict(dtype=torch.long, device=self.seqused_k.device)
        return torch.tensor(rows, **as_long), torch.tensor(seqs, **as_long), tuple(prefills)
