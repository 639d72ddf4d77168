"""FlashAttention-3 (flash-attention's ``hopper/``, Hopper GPUs) over the virtual cache: one kernel call a step.

FA3's KV-cache call takes varlen queries (``cu_seqlens_q``), causal from the bottom right: a mixed step --
prefill chunks attending to their cached prefixes and one-query decode rows -- is a single kernel, as vLLM runs
its steps, instead of FlashInfer's prefill kernel plus a decode kernel (W1 1.4% and the long-context workload
2% faster than that pair, ``bench/results/peer_fa3_h100.json``). Steps of one-query rows only (the CUDA-graph
decode steps) take the same call where FA3 was built with decode tiles (``tools/build_fa3.py``: 64-row tiles on
one MMA warpgroup, as vLLM's FA3 fork decodes): 2.7-2.9% faster than flash-attn's split-KV kernel at W1's and the
decode-heavy workload's batches, calls queued as graphs run them (``kv_arrangement_decode_tiles_h100.json``). FA3
as published, on 128-row tiles, only ties with flash-attn there, so without decode tiles -- or with
``VATTN_FA3_DECODE_TILES=0``, the build's run-time switch -- those steps stay on flash-attn's kernel.

FA3 reads the cache through a page table over the slots, not by slot (``cache_batch_idx``): by slot it
loads K/V with the tensor-memory accelerator in whole tiles of up to 176 rows, bounded only by the slot's end,
so a tile past a sequence's last mapped page faults on unbacked virtual memory (and it decoded 0.73-0.93x
flash-attn's kernel, ``bench/results/decode_attention_fa3_h100.json``). Through pages smaller than its tiles --
vLLM's path, 16-token blocks -- each row's load is predicated on the sequence's length. Page ``p`` of slot ``s``
is rows ``(s * slot_pages + p) * PAGE_TOKENS ...``: the cache viewed as pages in place, the table arithmetic,
built once a step on the device (inside the graph, for a CUDA-graph step).

New K/V are already in the cache (``AttentionStep`` wrote them), so the kernel's own append is not used.
``tools/build_fa3.py`` builds the forward kernels this calls.
"""

from __future__ import annotations

import os

import torch

from worker.attention.flash_attn_kvcache import FlashAttnKVCache
from worker.attention.metadata import AttentionMetadata, page_rows

PAGE_TOKENS = 64  # below FA3's smallest K/V tile (128 rows), so its loads stay per row


def import_fa3():
    """FlashAttention-3's ``flash_attn_interface`` module, or an ImportError that says how to get it."""
    try:
        import flash_attn_interface
    except ImportError as exc:
        raise ImportError(
            f"attention backend 'fa3' needs FlashAttention-3 ({exc}): build it from flash-attention's hopper/ "
            "directory (`python setup.py install` there, or tools/build_fa3.py for just the kernels vattn calls)"
        ) from exc
    return flash_attn_interface


def has_decode_tiles() -> bool:
    """Whether the FA3 that imports was built with decode tiles (``tools/build_fa3.py``) and they are not
    switched off (``VATTN_FA3_DECODE_TILES=0``)."""
    import flash_attn_3

    return getattr(flash_attn_3, "vattn_decode_tiles", False) and os.environ.get("VATTN_FA3_DECODE_TILES") != "0"


class FA3KVCache(FlashAttnKVCache):
    """Every sequence of a step in one FA3 call over the virtual cache's slots as pages; an all-decode step on
    flash-attn's split-KV kernel by slot where FA3 has no decode tiles, or the batch is larger than they serve best."""

    # A mixed step is one call whose tiles FA3 finds on the device from cu_seqlens_q and the lengths, given the same
    # shapes and bound on the query length at every call: it can be replayed in a CUDA graph (worker/mixed_graphs.py).
    graphs_mixed = True

    def __init__(self):
        fa3 = import_fa3()  # first: without FA3 the error names it, not flash-attn
        self._fa3, self._fa3_schedule = fa3.flash_attn_with_kvcache, fa3.get_scheduler_metadata
        self.fa3_decodes = has_decode_tiles()
        # KV splits of an all-decode step (0: FA3's heuristic); VATTN_FA3_DECODE_SPLITS sets it, for measurement.
        self.decode_splits = int(os.environ.get("VATTN_FA3_DECODE_SPLITS", "0"))
        # All-decode steps of more sequences than this run flash-attn's split-KV kernel even with decode tiles: 512
        # sequences on shared 2-4K-token prefixes decoded 1.5 s faster on it, W1's 128 and the decode-heavy 256
        # faster on the tiles (docs/performance.md). CUDA graphs are captured per batch size, so each bucket keeps
        # one kernel. VATTN_FA3_DECODE_TILES_MAX_BATCH sets it, for measurement.
        self.decode_tiles_max_batch = int(os.environ.get("VATTN_FA3_DECODE_TILES_MAX_BATCH", "256"))
        super().__init__()
        self._tabled: AttentionMetadata | None = None  # the step the page table is for (every layer shares it)
        self._table: torch.Tensor | None = None
        self._schedule: torch.Tensor | None = None  # an all-decode step's FA3 scheduler metadata, every layer's

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.max_query_len == 1 and (not self.fa3_decodes or len(meta.slots) > self.decode_tiles_max_batch):
            return super().forward(q, k_rows, v_rows, meta)
        page = page_rows(meta.slot_tokens, PAGE_TOKENS)
        # A CUDA-graph step's table spans max_model_len, and FA3 sizes its KV split by the table: the decode-heavy
        # workload's wall moved with max_model_len (docs/performance.md). An explicit split count is the A/B.
        splits = self.decode_splits if meta.max_query_len == 1 else 0
        if meta is not self._tabled:
            pages = torch.arange(-(-meta.max_kv_len // page), device=q.device, dtype=torch.int32)
            self._table = meta.slots[:, None] * (meta.slot_tokens // page) + pages
            self._tabled = meta
            # FA3 works out each sequence's KV blocks and splits in a kernel of its own before each call; for a decode
            # step that is ~3 us in each of 32 layers, so the step works it out once and every layer reuses it, as vLLM
            # does (the call then resets the tile counter the scheduler kept). Made with the arguments of the call below.
            self._schedule = None if meta.max_query_len != 1 else self._fa3_schedule(
                len(meta.slots), 1, self._table.shape[1] * page, q.shape[1], k_rows.shape[1], q.shape[2],
                meta.seqused_k, qkv_dtype=q.dtype, cu_seqlens_q=meta.cu_seqlens_q, page_size=page, causal=True,
                num_splits=splits)
        k_pages, v_pages = k_rows.unflatten(0, (-1, page)), v_rows.unflatten(0, (-1, page))
        return self._fa3(q, k_pages, v_pages, cache_seqlens=meta.seqused_k, page_table=self._table,
                         cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_query_len, causal=True,
                         num_splits=splits, scheduler_metadata=self._schedule)
