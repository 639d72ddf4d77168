"""AttentionMetadata: where one step's tokens come from and go to in the KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from worker.staging import to_device


def page_rows(slot_tokens: int, most: int) -> int:
    """Rows a page of a virtual slot handed to a paged kernel: the largest power of two up to ``most`` dividing
    ``slot_tokens`` (page ``p`` of slot ``s`` is then rows ``(s * slot_tokens // page + p) * page ...``)."""
    page = most
    while slot_tokens % page:
        page //= 2
    return page


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
    # Rows per slot, or per block of a paged cache: ``rows(layer).unflatten(0, (-1, slot_tokens))`` is
    # [slot, token, H, D] (or [block, token, H, D]).
    slot_tokens: int
    max_query_len: int
    max_kv_len: int
    block_tables: torch.Tensor | None = None  # [B, blocks] int32: each sequence's blocks (paged kernels only)
    block_tables_host: torch.Tensor | None = None  # the same in host memory, for kernels planned on the host

    @classmethod
    def build(cls, seqs: list[SeqAttention], cache, device: torch.device, reads: str) -> "AttentionMetadata":
        """From the step's sequences and the cache that holds them, for a backend that ``reads`` "rows" (every
        KV row of every sequence listed, to gather), "slots" (``seq_starts`` + ``seqused_k``) or "blocks"
        (a paged cache's block tables)."""
        gather = reads == "rows"
        if gather:
            kv_rows = [cache.token_rows(s.slot, 0, s.kv_len) for s in seqs]
            write_rows = [rows[s.kv_len - s.query_len :] for rows, s in zip(kv_rows, seqs)]
        else:
            write_rows = [cache.token_rows(s.slot, s.kv_len - s.query_len, s.kv_len) for s in seqs]
        q_lens = torch.tensor([0] + [s.query_len for s in seqs], dtype=torch.int32)
        k_lens = torch.tensor([0] + [s.kv_len for s in seqs], dtype=torch.int32)
        starts = [int(rows[0]) - (s.kv_len - s.query_len) for rows, s in zip(write_rows, seqs)]
        ints = torch.stack([q_lens.cumsum(0, dtype=torch.int32), k_lens.cumsum(0, dtype=torch.int32),
                            torch.tensor(starts + [starts[-1] + max(s.kv_len for s in seqs)], dtype=torch.int32),
                            torch.tensor([0] + [s.slot for s in seqs], dtype=torch.int32), k_lens])
        cu_q, cu_k, seq_starts, slots, used = to_device(ints, device)  # one copy for the small ones
        tables = cache.block_tables([s.slot for s in seqs]) if reads == "blocks" else None
        return cls(
            seqs=tuple(seqs),
            write_rows=to_device(torch.cat(write_rows), device),
            kv_rows=to_device(torch.cat(kv_rows), device) if gather else None,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            seq_starts=seq_starts,
            seqused_k=used[1:],
            slots=slots[1:],
            slot_tokens=cache.block_size if reads == "blocks" else cache.spec.slot_tokens,
            max_query_len=max(s.query_len for s in seqs),
            max_kv_len=max(s.kv_len for s in seqs),
            block_tables=to_device(tables, device) if tables is not None else None,
            block_tables_host=tables,
        )

    @cached_property
    def split(self) -> "DecodePrefillSplit":
        """For backends that batch one-query sequences apart from the longer chunks (worked out on first use
        and kept: every layer of the step shares this metadata)."""
        return DecodePrefillSplit.of(self)


@dataclass(frozen=True)
class DecodePrefillSplit:
    """A mixed step as two batches: the decode sequences (one query each) and the prefill chunks, each with
    its own per-sequence tensors (device) taken from the step's metadata."""

    decode_rows: torch.Tensor  # [decodes] long: their query rows
    decode_seqs: torch.Tensor  # [decodes] long: their indices in the step
    prefill_rows: slice | torch.Tensor  # the chunks' query rows: a slice where they are one run (no copy)
    prefill_seqs: torch.Tensor  # [chunks] long
    prefill_cu_seqlens_q: torch.Tensor  # [chunks + 1] int32
    prefill_max_query_len: int
    prefill_max_kv_len: int

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "DecodePrefillSplit":
        rows, seqs, prefill_rows, prefill_seqs, q_lens, row = [], [], [], [], [0], 0
        for i, seq in enumerate(meta.seqs):
            if seq.query_len == 1:
                rows.append(row)
                seqs.append(i)
            else:
                prefill_rows.extend(range(row, row + seq.query_len))
                prefill_seqs.append(i)
                q_lens.append(seq.query_len)
            row += seq.query_len
        device = meta.seqused_k.device
        chunks = [meta.seqs[i] for i in prefill_seqs]
        one_run = bool(prefill_rows) and prefill_rows[-1] - prefill_rows[0] + 1 == len(prefill_rows)

        def longs(values: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.long), device)

        return cls(
            longs(rows), longs(seqs), slice(prefill_rows[0], prefill_rows[-1] + 1) if one_run else longs(prefill_rows),
            longs(prefill_seqs), to_device(torch.tensor(q_lens).cumsum(0, dtype=torch.int32), device),
            max((s.query_len for s in chunks), default=0), max((s.kv_len for s in chunks), default=0),
        )
