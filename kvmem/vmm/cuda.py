"""CudaVMM: CUDA driver virtual memory management through ``cuda.bindings.driver``.

Every driver call is checked; a failure raises ``VMMError`` naming the call, its arguments and the
CUresult. Each reservation carries one leading guard page mapped read-only to a shared zero page: torch
only builds a tensor over an address the driver knows, and this keeps that true however much of the
reservation is unmapped, without pinning a real page of the cache.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kvmem.errors import VMMError

try:
    from cuda.bindings import driver as cu
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise ImportError("CudaVMM needs cuda-bindings: pip install 'vattn[cuda]'") from exc


_SUCCESS = cu.CUresult.CUDA_SUCCESS


class _ArrayInterface:
    """Exposes a device range to ``torch.as_tensor`` via ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class CudaVMM:
    """GPU memory as a VMM backend: ``cuMemAddressReserve``/``cuMemCreate``/``cuMemMap``/``cuMemSetAccess``."""

    def __init__(self, device_index: int = 0):
        self.device = torch.device("cuda", device_index)
        torch.zeros(1, device=self.device)  # the primary context torch uses, created now
        self._check(cu.cuInit(0), "cuInit")
        dev = self._check(cu.cuDeviceGet(device_index), "cuDeviceGet", device_index)
        self._ctx = self._check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain", device_index)
        self._bound = threading.local()
        self._prop = cu.CUmemAllocationProp()
        self._prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = device_index
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(self._check(cu.cuMemGetAllocationGranularity(self._prop, flag), "cuMemGetAllocationGranularity"))
        self._rw = self._access(cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._ro = self._access(cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
        self._zero: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _access(self, flags: Any) -> Any:
        desc = cu.CUmemAccessDesc()
        desc.location = self._prop.location
        desc.flags = flags
        return desc

    @staticmethod
    def _check(result: Any, call: str, *args: Any) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != _SUCCESS:
            _, name = cu.cuGetErrorName(err)
            shown = ", ".join(hex(a) if isinstance(a, int) and a > 4096 else repr(a) for a in args)
            raise VMMError(f"{call}({shown}) failed: {name.decode() if name else err}")
        return values[0] if len(values) == 1 else None

    def _bind(self) -> None:
        # Driver calls act on the calling thread's current context; the mapper thread has none yet.
        if not getattr(self._bound, "ok", False):
            self._check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self._bound.ok = True

    def reserve(self, size: int) -> int:
        self._bind()
        g = self.granularity
        base = int(self._check(cu.cuMemAddressReserve(size + g, 0, 0, 0), "cuMemAddressReserve", size + g))
        self.map_zero(base, g)
        return base + g

    def free(self, va: int, size: int) -> None:
        self._bind()
        g = self.granularity
        self.unmap(va - g, g)
        self._check(cu.cuMemAddressFree(va - g, size + g), "cuMemAddressFree", va - g, size + g)

    def create(self, size: int) -> Any:
        self._bind()
        return self._check(cu.cuMemCreate(size, self._prop, 0), "cuMemCreate", size)

    def release(self, handle: Any) -> None:
        self._bind()
        self._check(cu.cuMemRelease(handle), "cuMemRelease")

    def map(self, va: int, size: int, handle: Any) -> None:
        # On every ensure(): the two driver calls, checked, with no other work.
        self._bind()
        (err,) = cu.cuMemMap(va, size, 0, handle, 0)
        if err != _SUCCESS:
            self._check((err,), "cuMemMap", va, size)
        (err,) = cu.cuMemSetAccess(va, size, [self._rw], 1)
        if err != _SUCCESS:
            self._check((err,), "cuMemSetAccess", va, size)

    def map_run(self, va: int, size: int, handles: list[Any]) -> None:
        # A mapping each (cuMemMap is ~1.5 us on the H100), then one cuMemSetAccess over the run, the ~26 us call
        # of a page's two (bench/results/vmm_latency.json); PyTorch's expandable segments map their handles so.
        self._bind()
        for i, handle in enumerate(handles):
            (err,) = cu.cuMemMap(va + i * size, size, 0, handle, 0)
            if err != _SUCCESS:
                for done in range(i):
                    cu.cuMemUnmap(va + done * size, size)
                self._check((err,), "cuMemMap", va + i * size, size)
        (err,) = cu.cuMemSetAccess(va, size * len(handles), [self._rw], 1)
        if err != _SUCCESS:
            for done in range(len(handles)):
                cu.cuMemUnmap(va + done * size, size)
            self._check((err,), "cuMemSetAccess", va, size * len(handles))

    def set_access(self, va: int, size: int, writable: bool) -> None:
        self._bind()
        desc = self._rw if writable else self._ro
        self._check(cu.cuMemSetAccess(va, size, [desc], 1), "cuMemSetAccess", va, size)

    def map_zero(self, va: int, size: int, pages: int = 1) -> None:
        # One access call for the whole run, as map_run's.
        self._bind()
        zero = self._zero_page(size)
        for i in range(pages):
            (err,) = cu.cuMemMap(va + i * size, size, 0, zero, 0)
            if err != _SUCCESS:
                for done in range(i):
                    cu.cuMemUnmap(va + done * size, size)
                self._check((err,), "cuMemMap", va + i * size, size)
        self.set_access(va, size * pages, writable=False)

    def _zero_page(self, size: int) -> Any:
        """One zeroed physical page per page size, mapped read-only wherever zeros are wanted."""
        with self._lock:
            if size not in self._zero:
                handle = self.create(size)
                va = int(self._check(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve", size))
                self.map(va, size, handle)
                self._check(cu.cuMemsetD8(va, 0, size), "cuMemsetD8", va, size)
                self._check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
                self.unmap(va, size)
                self._check(cu.cuMemAddressFree(va, size), "cuMemAddressFree", va, size)
                self._zero[size] = handle
            return self._zero[size]

    def unmap(self, va: int, size: int) -> None:
        self._bind()
        (err,) = cu.cuMemUnmap(va, size)
        if err != _SUCCESS:
            self._check((err,), "cuMemUnmap", va, size)

    def tensor(self, va: int, size: int) -> torch.Tensor:
        g = self.granularity
        whole = torch.as_tensor(_ArrayInterface(va - g, size + g), device=self.device)
        return whole[g:]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        # The caller unmaps pages right after a copy; the copy must have read them by then.
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        with self._lock:
            for handle in self._zero.values():
                self.release(handle)
            self._zero.clear()
