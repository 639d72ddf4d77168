"""Swap space: a preempted sequence's K/V copied to host memory and back into a (new) slot."""

from __future__ import annotations

import torch


class SwapSpace:
    """Host copies of swapped-out sequences of one cache. Whoever swaps out checks capacity first
    (the scheduler's accounting); ``used_bytes`` says what is held."""

    def __init__(self, cache):
        self.cache = cache
        self.used_bytes = 0
        self._store: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def swap_out(self, seq_id: int, slot: int, tokens: int) -> None:
        """Copy tokens ``[0, tokens)`` of ``slot``, every layer, to host memory."""
        if seq_id in self._store:
            raise ValueError(f"sequence {seq_id} is already swapped out")
        rows = self.cache.token_rows(slot, 0, tokens).to(self.cache.device)
        cuda = self.cache.device.type == "cuda"
        saved = []
        for layer in range(self.cache.spec.num_layers):
            k, v = self.cache.rows(layer)
            saved.append((k[rows].to("cpu", non_blocking=cuda), v[rows].to("cpu", non_blocking=cuda)))
        if cuda:  # the copies above were asynchronous
            torch.cuda.synchronize(self.cache.device)
        self._store[seq_id] = saved
        self.used_bytes += tokens * self.cache.spec.bytes_per_token

    def swap_in(self, seq_id: int, slot: int) -> int:
        """Write a swapped sequence back into ``slot`` (already backed); returns its token count."""
        if seq_id not in self._store:
            raise ValueError(f"sequence {seq_id} is not swapped out")
        saved = self._store.pop(seq_id)
        tokens = saved[0][0].shape[0]
        device = self.cache.device
        for layer, (k_saved, v_saved) in enumerate(saved):
            self.cache.write(layer, slot, 0, k_saved.to(device), v_saved.to(device))
        self.used_bytes -= tokens * self.cache.spec.bytes_per_token
        return tokens

    def drop(self, seq_id: int) -> None:
        saved = self._store.pop(seq_id, None)
        if saved is not None:
            self.used_bytes -= saved[0][0].shape[0] * self.cache.spec.bytes_per_token
