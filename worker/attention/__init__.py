"""Attention: one call, several backends, all reading K/V where the cache keeps them.

``AttentionStep`` binds a step's metadata to a cache and a backend; the model calls it once per layer
with that layer's new q/k/v: the new K/V are written into the cache in place, then attended over.
"""

from __future__ import annotations

from typing import Protocol

import torch

from worker.attention.metadata import AttentionMetadata, SeqAttention


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``q`` ``[tokens, H, D]`` against the cache rows of this step's sequences -> ``[tokens, H, D]``."""


def get_backend(name: str) -> AttentionBackend:
    """``torch`` (reference, any device), ``paged`` (the same gather path over block tables), ``fa2``
    (FlashAttention-2 in torch, CUDA, virtual caches)."""
    from worker.attention.fa2 import FA2Attention
    from worker.attention.reference import ReferenceAttention

    backends = {"torch": ReferenceAttention, "paged": ReferenceAttention, "fa2": FA2Attention}
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(backends)}")
    return backends[name]()


class AttentionStep:
    """One step's attention for every layer: ``step(layer, q, k, v) -> out``."""

    def __init__(self, cache, backend: AttentionBackend, meta: AttentionMetadata):
        self.cache = cache
        self.backend = backend
        self.meta = meta

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_rows, v_rows = self.cache.rows(layer)
        k_rows[self.meta.write_rows] = k
        v_rows[self.meta.write_rows] = v
        return self.backend.forward(q, k_rows, v_rows, self.meta)


__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionStep", "SeqAttention", "get_backend"]
