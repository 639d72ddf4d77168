"""PagedKVCache: the PagedAttention baseline -- a fixed pool of token blocks and per-slot block tables."""

from __future__ import annotations

import torch

from kvmem.slots import NumberedSlotCache
from kvmem.spec import KVCacheSpec


class PagedKVCache(NumberedSlotCache):
    """vLLM-style paged KV cache with the same slot interface and stats as ``VirtualKVCache``.

    ``spec.layout`` must be ``"paged"``; ``spec.page_size`` is the block size in tokens (16 by default
    in ``paged_spec``). K and V are each one pool ``[num_blocks, block_size, num_layers, H, D]``
    allocated up front; a slot's tokens live in the blocks its block table lists. Freed slots return
    their blocks at once (there is no virtual memory to keep them in).
    """

    def __init__(self, spec: KVCacheSpec, pool_bytes: int, device: str | torch.device = "cpu"):
        if spec.layout != "paged":
            raise ValueError(f"PagedKVCache needs layout 'paged', got {spec.layout!r}")
        block_bytes = spec.page_size * spec.bytes_per_token  # K and V, all layers
        if pool_bytes < block_bytes:
            raise ValueError(f"pool_bytes={pool_bytes} holds no block of {block_bytes} bytes")
        super().__init__(spec, pool_bytes // block_bytes)
        self.block_bytes = block_bytes
        shape = (self.num_pages, spec.page_size, spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.device = torch.device(device)
        self._k = torch.empty(shape, dtype=spec.dtype, device=self.device)
        self._v = torch.empty(shape, dtype=spec.dtype, device=self.device)
        self._rows = [(self.k(i).flatten(0, 1), self.v(i).flatten(0, 1)) for i in range(spec.num_layers)]

    @property
    def block_size(self) -> int:
        return self.spec.page_size

    def k(self, layer: int) -> torch.Tensor:
        """K blocks of ``layer``: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self._k[:, :, self._layer(layer)]

    def v(self, layer: int) -> torch.Tensor:
        """V blocks of ``layer``: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self._v[:, :, self._layer(layer)]

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.spec.num_layers})")
        return layer

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` as ``[num_blocks * block_size, H, D]``: see ``token_rows``."""
        return self._rows[self._layer(layer)]

    def token_rows(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Row indices (see ``rows``) of tokens ``[start, stop)`` of ``slot``, through its block table."""
        with self._lock:
            table = torch.tensor(self._in_use(slot).pages, dtype=torch.long)
        positions = torch.arange(start, stop)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def block_table(self, slot: int) -> list[int]:
        """Block ids holding ``slot``'s tokens, in token order."""
        with self._lock:
            return list(self._in_use(slot).pages)

    def block_tables(self, slots: list[int]) -> torch.Tensor:
        """``[len(slots), max_blocks]`` int32 block tables, padded with 0, in host memory (a step stages them to
        the device with its other inputs)."""
        with self._lock:
            tables = [self._in_use(s).pages for s in slots]
            width = max((len(t) for t in tables), default=0)
            out = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).reshape(len(slots), width)
            return out

    def gather(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``slot``'s K and V of ``layer`` as contiguous ``[tokens, H, D]`` copies (reference path)."""
        with self._lock:
            index = self.token_rows(slot, 0, self._in_use(slot).tokens).to(self.device)
            k_rows, v_rows = self.rows(layer)
            return k_rows[index], v_rows[index]

    # -- SlotCache hooks -----------------------------------------------------------------------
    def _copy(self, slot: int, index: int, src: int, dst: int) -> None:
        self._k[dst] = self._k[src]
        self._v[dst] = self._v[src]

    def _pool_stats(self) -> tuple[int, int]:
        return self.num_pages * self.block_bytes, self.num_pages * self.block_bytes

    def close(self) -> None:
        """Drop the block pools now, not whenever the object is collected: a second cache made in this
        process while this one is still referenced gets the memory."""
        with self._lock:
            if self.num_pages == 0:
                return
            for slot, state in enumerate(self._slots):
                self._drop_tail(slot, 0)
                state.in_use, state.tokens = False, 0
            self._k = self._v = torch.empty(0, dtype=self.spec.dtype, device=self.device)
            self._rows = []
            self._free.clear()
            self.num_pages = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the blocks back to the driver, not only to torch's allocator


def paged_spec(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16, **kwargs) -> KVCacheSpec:
    """A ``KVCacheSpec`` for ``PagedKVCache`` with a block size of ``block_size`` tokens."""
    return KVCacheSpec(num_layers, num_kv_heads, head_dim, layout="paged", page_size=block_size, **kwargs)
