"""Attention: one call, several backends, all reading K/V where the cache keeps them.

``AttentionStep`` binds a step's metadata to a cache and a backend; the model calls it once per layer
with that layer's new q/k/v: the new K/V are written into the cache in place, then attended over.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from worker.attention.metadata import AttentionMetadata, SeqAttention
from worker.kernels import store_kv


class AttentionBackend(Protocol):
    # How the kernel finds a sequence's K/V: "rows" (every row listed: AttentionMetadata.kv_rows, then
    # gathered), "slots" (a virtual cache's slot read in place), "blocks" (a paged cache's block tables).
    reads: Literal["rows", "slots", "blocks"]

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``q`` ``[tokens, H, D]`` against the cache rows of this step's sequences -> ``[tokens, H, D]``."""


IN_PLACE = ("fa2", "flash_attn", "flashinfer", "fa3")  # CUDA kernels that read a virtual cache's slots where they are
PAGED_KERNELS = ("flash_attn_paged", "flashinfer_paged")  # CUDA kernels that read a paged cache's blocks through block tables
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # head sizes FlashInfer's prefill kernels are built for (32 fails at run time)
BACKENDS = ("torch", "paged", "invariant", *IN_PLACE, *PAGED_KERNELS)


def get_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """``torch`` (reference, any device), ``paged`` (block tables: the reference gather on CPU, gather +
    FA2 on CUDA), ``fa2`` (FlashAttention-2 in torch over a virtual cache, CUDA), ``flash_attn`` (the
    flash-attn package's ``flash_attn_with_kvcache`` over a virtual cache, CUDA, when it is installed),
    ``flash_attn_paged`` (the same package's block-table path over a paged cache of 256-token blocks),
    ``flashinfer`` / ``flashinfer_paged`` (FlashInfer's prefill kernel, FA3 on Hopper, over the virtual cache's
    slots as pages / the paged cache's blocks; flash-attn's decode), ``fa3`` (FlashAttention-3's KV-cache kernel,
    Hopper: every step in one call over the virtual cache; flash-attn's decode for the all-decode steps where
    FA3 was built without decode tiles), ``invariant`` (batch-invariant, for ``deterministic=True``: one Triton
    kernel for every step over a virtual cache on CUDA, a query at a time on CPU)."""
    from worker.attention.fa2 import FA2Attention, PagedGatherFA2
    from worker.attention.fa3 import FA3KVCache
    from worker.attention.flash_attn_kvcache import FlashAttnKVCache, FlashAttnPaged
    from worker.attention.flashinfer import FlashInferKVCache, FlashInferPaged
    from worker.attention.invariant import InvariantAttention
    from worker.attention.reference import ReferenceAttention

    cuda = torch.device(device).type == "cuda"
    backends = {
        "torch": ReferenceAttention,
        "paged": PagedGatherFA2 if cuda else ReferenceAttention,
        "fa2": FA2Attention,
        "flash_attn": FlashAttnKVCache,
        "flash_attn_paged": FlashAttnPaged,
        "flashinfer": FlashInferKVCache,
        "flashinfer_paged": FlashInferPaged,
        "fa3": FA3KVCache,
    }
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    if name in (*IN_PLACE, *PAGED_KERNELS) and not cuda:
        raise ValueError(f"attention backend {name!r} needs a CUDA device")
    if name == "invariant":
        return InvariantAttention(device)
    return backends[name]()


class AttentionStep:
    """One step's attention for every layer: ``step(layer, q, k, v) -> out``."""

    def __init__(self, cache, backend: AttentionBackend, meta: AttentionMetadata):
        self.cache = cache
        self.backend = backend
        self.meta = meta

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_rows, v_rows = self.cache.rows(layer)
        store_kv(k, v, k_rows, v_rows, self.meta.write_rows)
        return self.backend.forward(q, k_rows, v_rows, self.meta)


__all__ = ["BACKENDS", "FLASHINFER_HEAD_DIMS", "IN_PLACE", "PAGED_KERNELS", "AttentionBackend", "AttentionMetadata", "AttentionStep", "SeqAttention", "get_backend"]
