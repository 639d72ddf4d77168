"""KVCacheSpec: the shape of a KV cache and the geometry derived from it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

Layout = Literal["per_layer", "mega", "paged"]
LAYOUTS = ("per_layer", "mega", "paged")
MIN_PAGE = 4 << 10
MAX_PAGE = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    """What one worker caches: ``num_layers`` layers of ``num_kv_heads`` x ``head_dim`` K and V.

    ``layout``:
      * ``per_layer`` -- 2 x num_layers buffers ``[max_slots, max_tokens, H, D]`` (the vAttention paper);
      * ``mega`` -- one K and one V buffer ``[max_slots, max_tokens, num_layers, H, D]``; layer i is
        the strided view ``[:, :, i]``, so one page spans all layers;
      * ``paged`` -- the PagedAttention baseline; ``page_size`` is then the block size in tokens.

    For the virtual layouts ``page_size`` is in bytes (a power of two, 4 KiB .. 1 GiB). Derived sizes
    are computed once (the spec is frozen).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    max_slots: int = 64
    max_tokens: int = 4096
    layout: Layout = "mega"
    page_size: int = 2 << 20

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_slots", "max_tokens", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {value!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"KVCacheSpec.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVCacheSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.layout != "paged" and not (
            MIN_PAGE <= self.page_size <= MAX_PAGE and self.page_size & (self.page_size - 1) == 0
        ):
            raise ValueError(
                f"KVCacheSpec.page_size must be a power of two between {MIN_PAGE} and {MAX_PAGE} bytes "
                f"for layout {self.layout!r}, got {self.page_size}"
            )

    @cached_property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def layers_per_buffer(self) -> int:
        return 1 if self.layout == "per_layer" else self.num_layers

    @cached_property
    def num_buffers(self) -> int:
        """Virtual reservations (or block pools): 2 per layer, or one K and one V."""
        return 2 * self.num_layers if self.layout == "per_layer" else 2

    @cached_property
    def token_bytes(self) -> int:
        """Bytes one token occupies in one buffer."""
        return self.layers_per_buffer * self.num_kv_heads * self.head_dim * self.elem_bytes

    @cached_property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in the whole cache (K and V, all layers)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.elem_bytes

    @cached_property
    def slot_tokens(self) -> int:
        """Rows per slot in a buffer: max_tokens rounded up so that every slot starts on a page.

        Flattening a buffer to ``[max_slots * slot_tokens, ...]`` puts slot s at row ``s * slot_tokens``.
        """
        if self.layout == "paged":
            return self.max_tokens
        unit = self.page_size // math.gcd(self.page_size, self.token_bytes)
        return -(-self.max_tokens // unit) * unit

    @cached_property
    def slot_bytes(self) -> int:
        return self.slot_tokens * self.token_bytes

    @cached_property
    def pages_per_slot(self) -> int:
        return self.slot_bytes // self.page_size

    @cached_property
    def buffer_bytes(self) -> int:
        """Virtual bytes one buffer reserves."""
        return self.max_slots * self.slot_bytes

    @cached_property
    def reserved_bytes(self) -> int:
        return self.num_buffers * self.buffer_bytes

    def full_pages(self, tokens: int) -> int:
        """Pages (per buffer) the first ``tokens`` tokens of a slot fill completely: the ones a prefix cache can
        hold (a page whose last bytes are a token not yet computed is not full)."""
        if self.layout == "paged":
            return tokens // self.page_size
        return tokens * self.token_bytes // self.page_size

    def tokens_within(self, pages: int) -> int:
        """Tokens that lie entirely inside a slot's first ``pages`` pages."""
        if self.layout == "paged":
            return pages * self.page_size
        return pages * self.page_size // self.token_bytes

    def splits_token(self, pages: int) -> bool:
        """Whether a token runs over the end of a slot's first ``pages`` pages into the next."""
        return self.layout != "paged" and pages * self.page_size % self.token_bytes != 0

    def page_tokens(self, page: int) -> tuple[int, int]:
        """``[start, stop)``: the tokens with bytes in page ``page`` of a slot (where a page does not hold whole
        tokens, the first and last may lie partly in the pages beside it)."""
        if self.layout == "paged":
            return page * self.page_size, (page + 1) * self.page_size
        return page * self.page_size // self.token_bytes, -(-(page + 1) * self.page_size // self.token_bytes)

    def pages_for(self, tokens: int) -> int:
        """Pages (per buffer) that back the first ``tokens`` tokens of a slot; blocks for ``paged``."""
        if self.layout == "paged":
            return -(-tokens // self.page_size)
        return -(-tokens * self.token_bytes // self.page_size)

    @cached_property
    def page_bytes(self) -> int:
        """Physical bytes of one page (virtual layouts) or of one block in one buffer (paged)."""
        return self.page_size * self.token_bytes if self.layout == "paged" else self.page_size

    def physical_bytes_for(self, tokens: int) -> int:
        """Physical bytes a slot of ``tokens`` tokens holds across all buffers."""
        return self.pages_for(tokens) * self.page_bytes * self.num_buffers
