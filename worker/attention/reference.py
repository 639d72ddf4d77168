"""The pure-torch attention backend: gathers each sequence's K/V rows and runs SDPA (decode rows batched, over K/V
padded to the longest). Any device, any dtype, any cache (virtual rows or paged block rows): the reference the fast
backends are checked against."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from worker.attention.metadata import AttentionMetadata, SeqAttention


#: Padded K/V rows a batch of decode rows gathers at most (a sequence's rows repeat to the longest one's length).
DECODE_BATCH_ROWS = 1 << 18


class ReferenceAttention:
    reads = "rows"

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        decoding: list[tuple[int, int, int]] = []  # (query row, first of its kv_rows, kv_len) of each decode row
        q_at = k_at = 0
        for seq in meta.seqs:
            if seq.query_len == 1:
                decoding.append((q_at, k_at, seq.kv_len))
            else:
                k, v = _gather(k_rows, v_rows, meta.kv_rows[k_at : k_at + seq.kv_len])
                qs = q[q_at : q_at + seq.query_len].transpose(0, 1)  # [H, n, D]
                # Query j sits at position kv_len - query_len + j and sees every key up to it.
                offset = seq.kv_len - seq.query_len
                mask = (torch.arange(seq.kv_len, device=q.device)[None, :]
                        <= torch.arange(seq.query_len, device=q.device)[:, None] + offset)
                o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
                out[q_at : q_at + seq.query_len] = o.transpose(0, 1)
            q_at, k_at = q_at + seq.query_len, k_at + seq.kv_len
        # Decode rows in batches, each one SDPA call over K/V padded to its longest sequence: a call per sequence cost
        # a CPU ~0.1 ms each, most of a step of hundreds of sequences.
        decoding.sort(key=lambda d: d[2])
        start = 0
        while start < len(decoding):
            end = start + 1
            while end < len(decoding) and (end + 1 - start) * decoding[end][2] <= DECODE_BATCH_ROWS:
                end += 1
            _decode(q, k_rows, v_rows, meta.kv_rows, decoding[start:end], out)
            start = end
        return out


def _gather(k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of ``k_rows`` and ``v_rows`` as ``[Hkv, len(rows), D]`` each."""
    # index_select, not k_rows[rows]: on a CPU, indexing a strided view (one layer's rows of the mega layout)
    # copied the whole view first -- 2.4 ms against 7 us for 128 rows of a 33 MB view (torch 2.13).
    return k_rows.index_select(0, rows).transpose(0, 1), v_rows.index_select(0, rows).transpose(0, 1)


def _decode(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, kv_rows: torch.Tensor,
            rows: list[tuple[int, int, int]], out: torch.Tensor) -> None:
    """One SDPA call for decode rows ``(query row, first of its kv_rows, kv_len)``, into ``out``."""
    at, starts, lens = (torch.tensor(col) for col in zip(*rows))
    longest = int(lens.max())
    pos = torch.arange(longest)
    # Each sequence's rows, padded with its last one (masked out): [B, longest] positions into kv_rows.
    index = (starts[:, None] + torch.minimum(pos[None, :], lens[:, None] - 1)).to(kv_rows.device)
    k, v = (t.index_select(0, kv_rows[index.flatten()]).unflatten(0, index.shape).transpose(1, 2)
            for t in (k_rows, v_rows))  # [B, Hkv, longest, D]
    mask = (pos[None, :] < lens[:, None]).to(q.device)[:, None, None, :]
    at = at.to(q.device)
    o = F.scaled_dot_product_attention(q[at][:, :, None], k, v, attn_mask=mask, enable_gqa=True)
    out[at] = o[:, :, 0]


def gathered(k_rows: torch.Tensor, v_rows: torch.Tensor,
             meta: AttentionMetadata) -> Iterator[tuple[int, SeqAttention, torch.Tensor, torch.Tensor]]:
    """For each sequence of the step: its first query row, its part of the step, and its keys and values gathered
    from its rows, ``[Hkv, kv_len, D]`` each."""
    q_at = k_at = 0  # offsets from the host-side seqs: reading cu_seqlens would sync a GPU every layer
    for seq in meta.seqs:
        yield q_at, seq, *_gather(k_rows, v_rows, meta.kv_rows[k_at : k_at + seq.kv_len])
        q_at, k_at = q_at + seq.query_len, k_at + seq.kv_len
