"""HostVMM: the VMM mechanism on Linux host memory.

A reservation is ``PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``; physical pages are
offsets of one ``memfd_create`` file, committed with ``fallocate``; mapping is
``mmap(MAP_SHARED|MAP_FIXED)`` of such an offset inside the reservation, so the same page mapped at two
addresses is real sharing. Unmapping maps ``PROT_NONE`` back.

It refuses what CUDA refuses, so that CPU tests catch it: mapping over a mapping, unmapping what is not mapped or
part of a mapping.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import torch

from kvmem.errors import VMMError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

PROT_NONE = 0
MAP_FAILED = ctypes.c_void_p(-1).value
MAP_NORESERVE = 0x4000
MAP_FIXED = 0x10
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE


@dataclass(frozen=True)
class HostPage:
    """A physical page: a range of the memfd."""

    offset: int
    size: int


def _errno_message() -> str:
    err = ctypes.get_errno()
    return f"{os.strerror(err)} (errno {err})"


class HostVMM:
    """Linux host memory as a VMM backend (for CPU serving and CI)."""

    device = torch.device("cpu")

    def __init__(self, granularity: int = mmap.PAGESIZE):
        self.granularity = granularity
        self._fd = os.memfd_create("vattn-kv", os.MFD_CLOEXEC)
        self._file_size = 0
        self._free_offsets: dict[int, list[int]] = {}
        self._mapped: dict[int, int] = {}  # mapping start -> size
        self._starts: dict[int, int] = {}  # each granule a mapping covers -> that mapping's start

    def _mmap(self, call: str, va: int | None, size: int, prot: int, flags: int, fd: int = -1, off: int = 0) -> int:
        addr = _libc.mmap(va, size, prot, flags, fd, off)
        if addr in (None, MAP_FAILED) or (va is not None and addr != va):
            raise VMMError(f"mmap({call}, va={va and hex(va)}, size={size}) failed: {_errno_message()}")
        return addr

    def reserve(self, size: int) -> int:
        return self._mmap("reserve", None, size, PROT_NONE, _ANON)

    def free(self, va: int, size: int) -> None:
        inside = next((m for m in self._mapped if va <= m < va + size), None)
        if inside is not None:
            raise VMMError(f"free(va={hex(va)}, size={size}): {hex(inside)} is still mapped")
        if _libc.munmap(va, size) != 0:
            raise VMMError(f"munmap(va={hex(va)}, size={size}) failed: {_errno_message()}")

    def create(self, size: int) -> HostPage:
        free = self._free_offsets.get(size)
        offset = free.pop() if free else self._grow_file(size)
        # Commit the memory now: a pool page must be real memory, not a promise that faults later.
        if _libc.fallocate(self._fd, 0, offset, size) != 0:
            message = _errno_message()
            self._free_offsets.setdefault(size, []).append(offset)
            raise VMMError(f"fallocate(offset={offset}, size={size}) failed: {message}")
        return HostPage(offset, size)

    def _grow_file(self, size: int) -> int:
        offset = self._file_size
        os.ftruncate(self._fd, offset + size)
        self._file_size += size
        return offset

    def release(self, handle: HostPage) -> None:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if _libc.fallocate(self._fd, mode, handle.offset, handle.size) != 0:
            raise VMMError(f"fallocate(PUNCH_HOLE, offset={handle.offset}) failed: {_errno_message()}")
        self._free_offsets.setdefault(handle.size, []).append(handle.offset)

    def map(self, va: int, size: int, handle: HostPage) -> None:
        if size != handle.size:
            raise VMMError(f"map(va={hex(va)}): size {size} differs from the page's {handle.size}")
        self._check_unmapped("map", va, size)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        self._mmap("map", va, size, prot, mmap.MAP_SHARED | MAP_FIXED, self._fd, handle.offset)
        self._record(va, size)

    def _check_unmapped(self, call: str, va: int, size: int) -> None:
        taken = next((g for g in range(va, va + size, self.granularity) if g in self._starts), None)
        if taken is not None:
            raise VMMError(f"{call}(va={hex(va)}, size={size}): {hex(taken)} is mapped already")

    def _record(self, va: int, size: int) -> None:
        self._mapped[va] = size
        self._starts.update((g, va) for g in range(va, va + size, self.granularity))

    def map_run(self, va: int, size: int, handles: list[HostPage]) -> None:
        for i, handle in enumerate(handles):
            try:
                self.map(va + i * size, size, handle)
            except VMMError:
                for done in range(i):
                    self.unmap(va + done * size, size)
                raise

    def map_zero(self, va: int, size: int, pages: int = 1) -> None:
        # Private anonymous read-only memory reads as the kernel's zero page and costs no memory.
        self._check_unmapped("map_zero", va, size * pages)
        for i in range(pages):
            self._mmap("map_zero", va + i * size, size, mmap.PROT_READ, _ANON | MAP_FIXED)
            self._record(va + i * size, size)

    def unmap(self, va: int, size: int) -> None:
        at = va
        while at < va + size:  # whole mappings, one after another, nothing unmapped between
            if self._starts.get(at) != at or at + self._mapped[at] > va + size:
                raise VMMError(f"unmap(va={hex(va)}, size={size}): {hex(at)} does not start a mapping that ends "
                               f"inside the range")
            at += self._mapped[at]
        at = va
        while at < va + size:
            for g in range(at, at + self._mapped[at], self.granularity):
                del self._starts[g]
            at += self._mapped.pop(at)
        self._mmap("unmap", va, size, PROT_NONE, _ANON | MAP_FIXED)

    def tensor(self, va: int, size: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_char * size).from_address(va), dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
