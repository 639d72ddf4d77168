"""The flash-attn package's ``flash_attn_with_kvcache`` over the virtual cache, addressed by slot.

The cache's ``[slot, token, H, D]`` view is the kernel's ``k_cache``; ``cache_batch_idx`` picks each
sequence's slot and ``cache_seqlens`` its length, so nothing is copied or gathered -- the call the
vAttention paper makes. New K/V are already in the cache (``AttentionStep`` wrote them), so the kernel's
own append (``k=``/``v=``) is not used. Every call passes ``cache_batch_idx``, which also pins flash-attn to
its split-KV kernels (the only ones ``tools/build_flash_attn.py`` compiles by default).
"""

from __future__ import annotations

import torch

from worker.attention.metadata import AttentionMetadata


def import_flash_attn():
    """``flash_attn.flash_attn_with_kvcache``, or an ImportError that says how to get it."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as exc:
        raise ImportError(
            f"attention backend 'flash_attn' needs the flash-attn package ({exc}); `pip install flash-attn` "
            "builds it against the installed torch, or tools/build_flash_attn.py builds just its KV-cache kernels"
        ) from exc
    return flash_attn_with_kvcache


class FlashAttnKVCache:
    """Decode sequences (one query each) in one batched call; each prefill chunk in a call of its own,
    causal from the bottom right so that a chunk attends to its cached prefix."""

    gathers = False

    def __init__(self):
        self._kvcache = import_flash_attn()

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k_cache = k_rows.unflatten(0, (-1, meta.slot_tokens))
        v_cache = v_rows.unflatten(0, (-1, meta.slot_tokens))
        if meta.max_query_len == 1:  # all decode (and every CUDA-graph step, whose meta lists no seqs)
            return self._decode(q, k_cache, v_cache, meta.seqused_k, meta.slots)
        rows, seqs, prefills = meta.decode_split
        out = torch.empty_like(q)
        if len(rows):
            out[rows] = self._decode(q[rows], k_cache, v_cache, meta.seqused_k[seqs], meta.slots[seqs])
        for i, start, stop in prefills:
            out[start:stop] = self._kvcache(
                q[None, start:stop], k_cache, v_cache,
                cache_seqlens=meta.seqused_k[i : i + 1], cache_batch_idx=meta.slots[i : i + 1], causal=True,
            )[0]
        return out

    def _decode(self, q, k_cache, v_cache, lengths, slots) -> torch.Tensor:
        # One query sees its whole prefix, so no mask; the kernel folds each KV head's query heads into the
        # query length (one K/V read per KV head).
        return self._kvcache(q[:, None], k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=slots)[:, 0]
