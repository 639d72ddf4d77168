"""Host tensors to the GPU without waiting for the work queued there.

A copy from pageable host memory to a GPU synchronizes the stream (torch's blocking copy), so a worker that
launches step k+1 while step k runs would wait for step k at its first such copy. A copy from pinned memory
with ``non_blocking`` only queues; torch's caching host allocator keeps each staging buffer until its copy ran.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, queued behind the device's work (returned as is on the CPU)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
