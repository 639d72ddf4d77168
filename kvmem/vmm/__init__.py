"""Virtual-memory backends: reserve virtual ranges, create physical pages, map them on demand.

Two real implementations share one protocol: ``CudaVMM`` (CUDA driver VMM, GPU) and ``HostVMM``
(mmap + memfd, Linux host memory).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvmem.vmm.host import HostVMM


class VMM(Protocol):
    """What the cache needs from a virtual-memory system. Sizes are multiples of ``granularity``."""

    granularity: int
    device: torch.device

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of virtual address space; returns the base address."""

    def free(self, va: int, size: int) -> None:
        """Give back a reservation (everything in it must be unmapped)."""

    def create(self, size: int) -> Any:
        """Create a physical page of ``size`` bytes; returns an opaque handle."""

    def release(self, handle: Any) -> None:
        """Give a physical page back to the system (it must be mapped nowhere)."""

    def map(self, va: int, size: int, handle: Any) -> None:
        """Map ``handle`` read-write at ``va`` (the range must be unmapped)."""

    def map_run(self, va: int, size: int, handles: list[Any]) -> None:
        """Map ``handles`` back to back from ``va``, ``size`` bytes each, read-write (the range must be unmapped).
        Each stays its own mapping (``unmap`` one at a time); CUDA sets the access of the whole run in one call."""

    def map_zero(self, va: int, size: int, pages: int = 1) -> None:
        """Map read-only zeros over ``pages`` pages of ``size`` bytes from ``va`` (each its own mapping, as
        ``map_run``'s) so that stray reads see zeros instead of faulting."""

    def unmap(self, va: int, size: int) -> None:
        """Unmap ``[va, va + size)``: whole earlier ``map``/``map_zero``/``map_run`` pages, one or several adjacent
        (one driver call for them all on CUDA)."""

    def tensor(self, va: int, size: int) -> torch.Tensor:
        """A flat uint8 tensor over ``[va, va + size)`` of a reservation, without copying."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy between two views on this device, complete when it returns."""

    def close(self) -> None:
        """Release what the backend itself holds (zero pages)."""


def default_vmm(device: str | torch.device | None = None) -> VMM:
    """CudaVMM for a CUDA device, HostVMM otherwise."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        from kvmem.vmm.cuda import CudaVMM

        return CudaVMM(dev.index or 0)
    if dev.type != "cpu":
        raise ValueError(f"no VMM backend for device {dev}")
    return HostVMM()


__all__ = ["VMM", "HostVMM", "default_vmm"]
