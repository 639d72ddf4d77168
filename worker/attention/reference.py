"""The pure-torch attention backend: gathers each sequence's K/V rows and runs SDPA (decode rows batched, over K/V
padded to the longest). Any device, any dtype, any cache (virtual rows or paged block rows): the reference the fast
backends are checked against."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention.metadata import AttentionMetadata, SeqAttention


#: Padded K/V rows a batch of decode rows gathers at most (a sequence's rows repeat to the longest one's length).
DECODE_BATCH_ROWS = 1 << 18


@dataclass(frozen=True)
class DecodeBatch:
    """Decode rows that go to SDPA in one call, over K/V padded to the longest of their sequences."""

    at: torch.Tensor  # [B] their query rows
    rows: torch.Tensor  # [B * longest] cache rows, each sequence's padded with its last one
    shape: tuple[int, int]  # (B, longest)
    mask: torch.Tensor  # [B, 1, 1, longest]: the rows that are the sequence's own


class ReferenceAttention:
    reads = "rows"

    def __init__(self):
        self._batches: tuple[AttentionMetadata, list[DecodeBatch]] | None = None  # the step's, shared by its layers

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        for q_at, seq, k, v in gathered(k_rows, v_rows, meta, lambda seq: seq.query_len > 1):
            qs = q[q_at : q_at + seq.query_len].transpose(0, 1)  # [H, n, D]
            # Query j sits at position kv_len - query_len + j and sees every key up to it.
            offset = seq.kv_len - seq.query_len
            mask = (torch.arange(seq.kv_len, device=q.device)[None, :]
                    <= torch.arange(seq.query_len, device=q.device)[:, None] + offset)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
            out[q_at : q_at + seq.query_len] = o.transpose(0, 1)
        # Decode rows in batches, one SDPA call each: a call per sequence cost a CPU ~0.1 ms, most of a step of
        # hundreds of sequences.
        for batch in self._decode_batches(meta, q.device):
            k, v = (t.index_select(0, batch.rows).unflatten(0, batch.shape).transpose(1, 2) for t in (k_rows, v_rows))
            o = F.scaled_dot_product_attention(q[batch.at][:, :, None], k, v, attn_mask=batch.mask, enable_gqa=True)
            out[batch.at] = o[:, :, 0]
        return out

    def _decode_batches(self, meta: AttentionMetadata, device: torch.device) -> list[DecodeBatch]:
        """The step's decode rows in batches of at most ``DECODE_BATCH_ROWS`` padded rows, shortest sequences first;
        worked out at the step's first layer."""
        if self._batches is None or self._batches[0] is not meta:
            decoding, q_at, k_at = [], 0, 0  # (query row, first of its kv_rows, kv_len) of each decode row
            for seq in meta.seqs:
                if seq.query_len == 1:
                    decoding.append((q_at, k_at, seq.kv_len))
                q_at, k_at = q_at + seq.query_len, k_at + seq.kv_len
            decoding.sort(key=lambda d: d[2])
            batches, start = [], 0
            while start < len(decoding):
                end = start + 1
                while end < len(decoding) and (end + 1 - start) * decoding[end][2] <= DECODE_BATCH_ROWS:
                    end += 1
                batches.append(_batch(decoding[start:end], meta.kv_rows, device))
                start = end
            self._batches = (meta, batches)
        return self._batches[1]


def _batch(decoding: list[tuple[int, int, int]], kv_rows: torch.Tensor, device: torch.device) -> DecodeBatch:
    at, starts, lens = (torch.tensor(col) for col in zip(*decoding))
    longest = int(lens.max())
    pos = torch.arange(longest)
    index = (starts[:, None] + torch.minimum(pos[None, :], lens[:, None] - 1)).to(kv_rows.device)
    mask = (pos[None, :] < lens[:, None]).to(device)[:, None, None, :]
    return DecodeBatch(at.to(device), kv_rows[index.flatten()], (len(decoding), longest), mask)


def gathered(k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata,
             which: Callable[[SeqAttention], bool] = lambda seq: True,
             ) -> Iterator[tuple[int, SeqAttention, torch.Tensor, torch.Tensor]]:
    """For each sequence of the step (``which`` of them): its first query row, its part of the step, and its keys and
    values gathered from its rows, ``[Hkv, kv_len, D]`` each."""
    q_at = k_at = 0  # offsets from the host-side seqs: reading cu_seqlens would sync a GPU every layer
    for seq in meta.seqs:
        if which(seq):
            rows = meta.kv_rows[k_at : k_at + seq.kv_len]
            # index_select, not k_rows[rows]: on a CPU, indexing a strided view (one layer's rows of the mega layout)
            # copied the whole view first -- 2.4 ms against 7 us for 128 rows of a 33 MB view (torch 2.13).
            yield q_at, seq, k_rows.index_select(0, rows).transpose(0, 1), v_rows.index_select(0, rows).transpose(0, 1)
        q_at, k_at = q_at + seq.query_len, k_at + seq.kv_len
