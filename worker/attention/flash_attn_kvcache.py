"""The flash-attn package's kernels over the two caches: the virtual one addressed by slot, and the paged
baseline through block tables -- the vAttention paper's FA2_vAttention against FA2_Paged.

Virtual (``FlashAttnKVCache``): the cache's ``[slot, token, H, D]`` view is ``flash_attn_with_kvcache``'s
``k_cache``; ``cache_batch_idx`` picks each sequence's slot and ``cache_seqlens`` its length, so nothing is
copied or gathered. Prefill chunks, contiguous in virtual memory, take the plain varlen FlashAttention-2
kernel (torch's, over the cache in place) that a paged cache cannot use.

Paged (``FlashAttnPaged``): the same decode call with ``block_table`` instead of ``cache_batch_idx``, and
prefill chunks in one ``flash_attn_varlen_func`` call with ``block_table`` -- how vLLM ran FlashAttention-2
over its paged cache. flash-attn's paged path needs blocks of a multiple of 256 tokens.

New K/V are already in the cache (``AttentionStep`` wrote them), so the kernels' own append (``k=``/``v=``)
is not used. Both decode calls pin flash-attn to its split-KV kernels (the only ones
``tools/build_flash_attn.py`` compiles by default).
"""

from __future__ import annotations

import torch

from worker.attention.metadata import AttentionMetadata


def import_flash_attn():
    """The ``flash_attn`` module, or an ImportError that says how to get it."""
    try:
        import flash_attn
    except ImportError as exc:
        raise ImportError(
            f"attention backends 'flash_attn' and 'flash_attn_paged' need the flash-attn package ({exc}); "
            "`pip install flash-attn` builds it against the installed torch, or tools/build_flash_attn.py builds "
            "just its KV-cache kernels"
        ) from exc
    return flash_attn


class _FlashAttn:
    """A step's decode sequences (one query each) in one ``flash_attn_with_kvcache`` call, its prefill chunks in
    one varlen call, causal from the bottom right so that a chunk attends to its cached prefix. Subclasses say
    how the kernels find a sequence's K/V."""

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # [slot, token, H, D] of a virtual cache, [block, token, H, D] of a paged one
        k_cache = k_rows.unflatten(0, (-1, meta.slot_tokens))
        v_cache = v_rows.unflatten(0, (-1, meta.slot_tokens))
        if meta.max_query_len == 1:  # all decode (and every CUDA-graph step, whose meta lists no seqs)
            return self._decode(q, k_cache, v_cache, meta, slice(None))
        split = meta.split
        out = torch.empty_like(q)
        if len(split.decode_rows):
            out[split.decode_rows] = self._decode(q[split.decode_rows], k_cache, v_cache, meta, split.decode_seqs)
        rows = split.prefill_rows
        into = out[rows] if isinstance(rows, slice) else None  # one run of rows: a view a kernel can write into
        prefill = self._prefill(q[rows], k_rows, v_rows, k_cache, v_cache, meta, into)
        if prefill is not into:
            out[rows] = prefill
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, seqs) -> torch.Tensor:
        """``q`` of the sequences ``seqs`` (indices into the step's per-sequence tensors) -> their output."""

    def _prefill(self, q, k_rows, v_rows, k_cache, v_cache, meta: AttentionMetadata, into: torch.Tensor | None) -> torch.Tensor:
        """``q`` of the step's prefill chunks (``meta.split``) -> their output: ``into`` itself where it is given
        and the kernel writes there, else a new tensor."""


class FlashAttnKVCache(_FlashAttn):
    """By slot: decode through ``cache_batch_idx``; prefill chunks through the plain varlen FA2 kernel, which
    reads each slot's rows in place."""

    reads = "slots"

    def __init__(self):
        self._kvcache = import_flash_attn().flash_attn_with_kvcache

    def _decode(self, q, k_cache, v_cache, meta, seqs):
        # One query sees its whole prefix, so no mask; the kernel folds each KV head's query heads into the
        # query length (one K/V read per KV head).
        return self._kvcache(q[:, None], k_cache, v_cache, cache_seqlens=meta.seqused_k[seqs],
                             cache_batch_idx=meta.slots[seqs])[:, 0]

    def _prefill(self, q, k_rows, v_rows, k_cache, v_cache, meta, into):
        split = meta.split
        seqs = split.prefill_seqs
        starts = meta.seq_starts[seqs]
        # aten's FA2 wants B + 1 offsets; with seqused_k only the first B are read.
        return torch.ops.aten._flash_attention_forward(
            q, k_rows, v_rows, split.prefill_cu_seqlens_q, torch.cat([starts, starts[-1:]]), split.prefill_max_query_len,
            split.prefill_max_kv_len, 0.0, True, False, seqused_k=meta.seqused_k[seqs],
        )[0]


class FlashAttnPaged(_FlashAttn):
    """Through block tables: decode through ``flash_attn_with_kvcache(block_table=...)``, prefill chunks through
    ``flash_attn_varlen_func(block_table=...)``."""

    reads = "blocks"

    def __init__(self):
        fa = import_flash_attn()
        self._kvcache, self._varlen = fa.flash_attn_with_kvcache, fa.flash_attn_varlen_func

    def _decode(self, q, k_cache, v_cache, meta, seqs):
        return self._kvcache(q[:, None], k_cache, v_cache, cache_seqlens=meta.seqused_k[seqs],
                             block_table=meta.block_tables[seqs])[:, 0]

    def _prefill(self, q, k_rows, v_rows, k_cache, v_cache, meta, into):
        split = meta.split
        seqs = split.prefill_seqs
        cu_k = torch.nn.functional.pad(meta.seqused_k[seqs].cumsum(0, dtype=torch.int32), (1, 0))
        return self._varlen(q, k_cache, v_cache, split.prefill_cu_seqlens_q, cu_k, split.prefill_max_query_len,
                            split.prefill_max_kv_len, causal=True, block_table=meta.block_tables[seqs])
