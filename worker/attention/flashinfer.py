"""FlashInfer's prefill kernel (FA3 on Hopper) for a step's prefill chunks, flash-attn's decode for the rest.

FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` reads K/V through page lists. Over the virtual cache
(``FlashInferKVCache``) a slot's rows are contiguous, so they are handed over as consecutive pages of
``page_tokens`` rows: page ``p`` of slot ``s`` is rows ``(s * slot_pages + p) * page_tokens ...``, the cache
viewed as ``[pages, page_tokens, H, D]`` in place -- FlashInfer's kernel, unmodified, over virtual memory.
(One page per slot would also do, but FlashInfer splits work by pages; 256-token pages keep its strides in
32 bits for any slot length.) Over the paged cache (``FlashInferPaged``) the pages are its blocks.

Decode stays on flash-attn's split-KV kernel (``FlashAttnKVCache`` / ``FlashAttnPaged``): it is captured in
CUDA graphs, and at batch >= 64 FlashInfer's decode is no faster (docs/performance.md).

A plan (FlashInfer's host-side schedule, shared by every layer of a step) is made on the step's first
prefill call. Two wrappers take turns: a plan's pinned staging buffer must not be rewritten while the
previous step, launched ahead, may still be waiting to copy it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from itertools import accumulate

import torch

from worker.attention.flash_attn_kvcache import FlashAttnKVCache, FlashAttnPaged
from worker.attention.metadata import AttentionMetadata, page_rows

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)
PAGE_TOKENS = 256


def import_flashinfer():
    """The ``flashinfer`` module, or an ImportError that says how to get it."""
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(
            f"attention backends 'flashinfer' and 'flashinfer_paged' need the flashinfer-python package ({exc}); "
            "`pip install flashinfer-python` (tools/gpu_flashinfer_wheels.sh carries it to a machine without network)"
        ) from exc
    return flashinfer



class _FlashInferPrefill(ABC):
    """Prefill chunks through FlashInfer's paged prefill wrapper; subclasses say what a page is."""

    def __init__(self):
        self._flashinfer = import_flashinfer()
        self._wrappers: list = []
        self._turn = 0
        self._planned: AttentionMetadata | None = None  # the step the current plan is for
        self._page = 0

    @abstractmethod
    def _pages(self, meta: AttentionMetadata, seqs: list[int]) -> tuple[int, list[list[int]]]:
        """Tokens a page, and the pages of each of the step's sequences ``seqs`` in token order."""

    def _prefill(self, q, k_rows, v_rows, k_cache, v_cache, meta, into):
        if meta is not self._planned:
            self._plan(q, k_rows, meta)
        page = self._page
        # With ``out`` the wrapper neither allocates nor zero-fills its output, and the caller copies nothing.
        out = into if into is not None else torch.empty_like(q)
        self._wrappers[self._turn].run(q, (k_rows.unflatten(0, (-1, page)), v_rows.unflatten(0, (-1, page))), out=out)
        return out

    def _plan(self, q: torch.Tensor, k_rows: torch.Tensor, meta: AttentionMetadata) -> None:
        if not self._wrappers:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self._wrappers = [self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD") for _ in range(2)]
        self._turn ^= 1
        seqs = [i for i, s in enumerate(meta.seqs) if s.query_len > 1]
        page, tables = self._pages(meta, seqs)
        chunks = [meta.seqs[i] for i in seqs]

        def pinned(values) -> torch.Tensor:  # the wrapper reads these on the host and queues their copies
            return torch.tensor(list(values), dtype=torch.int32, pin_memory=True)

        indices = pinned(p for t in tables for p in t).to(q.device, non_blocking=True)
        self._wrappers[self._turn].plan(
            pinned(accumulate((s.query_len for s in chunks), initial=0)),
            pinned(accumulate((len(t) for t in tables), initial=0)), indices,
            pinned(s.kv_len - (len(t) - 1) * page for s, t in zip(chunks, tables)),
            q.shape[1], k_rows.shape[1], q.shape[2], page, causal=True, q_data_type=q.dtype, kv_data_type=k_rows.dtype,
        )
        self._planned, self._page = meta, page


class FlashInferKVCache(_FlashInferPrefill, FlashAttnKVCache):
    """The virtual cache: FlashInfer prefill over each slot's rows as consecutive pages, flash-attn decode."""

    def __init__(self):
        _FlashInferPrefill.__init__(self)
        FlashAttnKVCache.__init__(self)

    def _pages(self, meta, seqs):
        page = page_rows(meta.slot_tokens, PAGE_TOKENS)
        per_slot = meta.slot_tokens // page
        return page, [[s.slot * per_slot + p for p in range(-(-s.kv_len // page))] for s in (meta.seqs[i] for i in seqs)]


class FlashInferPaged(_FlashInferPrefill, FlashAttnPaged):
    """The paged cache: FlashInfer prefill over its blocks, flash-attn's block-table decode."""

    def __init__(self):
        _FlashInferPrefill.__init__(self)
        FlashAttnPaged.__init__(self)

    def _pages(self, meta, seqs):
        page = meta.slot_tokens  # a block's tokens
        return page, [meta.block_tables_host[i, : -(-meta.seqs[i].kv_len // page)].tolist() for i in seqs]
