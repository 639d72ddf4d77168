"""Small all-reduces over the TP ranks of one host through peer memory: each rank copies its partial sum into a
buffer every rank has mapped (torch symmetric memory), and one kernel reads every peer's copy over NVLink and adds
them in rank order (torch's ``one_shot_all_reduce``). A decode step's sums are 0.5-2 MiB each, two a layer, where
NCCL's latency dominates (docs/performance.md, "Two GPUs": 0.7-1.2 ms of 64 sums, against 0.5 ms this way). Larger
sums (prefill chunks) stay with NCCL.

No NVLink multicast (the machines keep it off): the one-shot kernel needs only peer loads. vLLM's custom all-reduce
is the same idea in its own kernel.

``VATTN_PEER_ALL_REDUCE=lamport`` (16-bit sums; to be measured against the one-shot kernel) sums with a kernel of
ours that needs no barrier, TensorRT-LLM's Lamport scheme: each rank writes its part into every rank's buffer, and
each adds the parts in rank order as they arrive -- a value that is not the sentinel (negative zero, which no part
carries: a part's -0 is sent as +0) has arrived. The one-shot kernel's barrier is a round trip between the GPUs
before any byte moves; here the parts move at once and the wait is for them. Three buffers take the calls in turn,
and a call first sets the one the call before used back to the sentinel: no rank writes into it again before this
rank's next call has sent its part, which comes after this call on this rank's stream (all of it: the call before's
element count is kept beside the counter, since a smaller sum may follow a larger one). Which buffer a call uses is a
counter on the device, so CUDA graphs replay the sums as eager steps run them; the sums of a group must therefore come
from one stream at a time, in the same order on every rank (as a step's layers make them).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the Lamport kernel needs Triton, and GPUs
    triton = None

logger = logging.getLogger(__name__)

#: Sums up to this many bytes go through peer memory: 256 decode rows of an 8192-wide model in bf16 (4 MiB).
DEFAULT_MAX_BYTES = 4 << 20
KERNELS = ("one_shot", "lamport")
SENTINEL = -32768  # 0x8000 as int16: negative zero in bfloat16 and float16 (the Lamport kernel's)
LAMPORT_BLOCK = 2048  # elements a program sums


class PeerAllReduce:
    """One rank's symmetric buffer and the group it was exchanged with. Build it with ``connect``, on every rank
    of the group at once (the exchange is a collective)."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int, lamport: "LamportState | None" = None):
        self.buffer = buffer  # uint8, mapped by every rank of the group
        self.group_name = group_name
        self.max_bytes = max_bytes
        self.lamport = lamport

    @classmethod
    def connect(cls, tp, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES,
                kernel: str | None = None) -> "PeerAllReduce | None":
        """The buffer, exchanged over ``tp``'s group (a ``TPGroup``) and checked with a sum every rank can verify;
        None (NCCL then takes every sum) where symmetric memory does not work here, saying why. Every rank must
        call it, and they agree: a rank whose check failed makes every rank return None (``TPGroup.failed_rank``).
        ``kernel``: "one_shot" (torch's) or "lamport" (ours); None: ``VATTN_PEER_ALL_REDUCE``, else "one_shot"."""
        import torch.distributed as dist

        kernel = kernel or os.environ.get("VATTN_PEER_ALL_REDUCE", "one_shot")
        if kernel not in KERNELS:
            raise ValueError(f"peer all-reduce kernel must be one of {KERNELS}, got {kernel!r} (VATTN_PEER_ALL_REDUCE)")
        group_name = (tp.group if tp.group is not None else dist.group.WORLD).group_name
        error = None
        peer = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if kernel == "lamport":
                if triton is None:
                    raise RuntimeError("the Lamport kernel needs Triton")
                # three buffers, each a region per source rank
                buffer = symm_mem.empty(3 * tp.size * max_bytes, dtype=torch.uint8, device=device)
                buffer.view(torch.int16).fill_(SENTINEL)
                handle = symm_mem.rendezvous(buffer, group_name)
                if handle.buffer_ptrs[tp.rank] != buffer.data_ptr() or max_bytes % 16:
                    raise RuntimeError(f"the Lamport kernel needs its buffer at its own address and 16-byte regions "
                                       f"(max_bytes={max_bytes})")
                lamport = LamportState(torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device),
                                       torch.zeros(3, dtype=torch.int64, device=device), tp.rank, tp.size,
                                       max_bytes // 2)
                tp.barrier(device)  # every rank's buffers hold the sentinel before any rank sends a part
                peer = cls(buffer, group_name, max_bytes, lamport)
                probe = torch.full((1024,), float(tp.rank + 1), dtype=torch.bfloat16, device=device)
            else:
                buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
                symm_mem.rendezvous(buffer, group_name)
                peer = cls(buffer, group_name, max_bytes)
                # Each rank adds rank + 1 in float32: the sum is n(n+1)/2 exactly, on every rank.
                probe = torch.full((1024,), float(tp.rank + 1), device=device)
            peer.all_reduce(probe)
            if not bool((probe == tp.size * (tp.size + 1) / 2).all()):
                raise RuntimeError(f"a probe sum over {tp.size} ranks came out as {probe[0].item()}")
        except Exception as exc:  # no symmetric memory here (no peer access, an old driver): NCCL for everything
            error = exc
        failed = tp.failed_rank(error is not None, device)  # every rank answers the same
        if failed is None:
            return peer
        if error is not None:
            logger.warning("all-reduces stay on NCCL: symmetric memory over the TP group failed (%s: %s)",
                           type(error).__name__, error)
        return None

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through peer memory: contiguous, small enough, a whole number of 16-byte vectors, a type
        the kernel adds (float32 or bfloat16; the Lamport kernel's: bfloat16 or float16). From its shape alone, so
        every rank decides alike (a rank summing through peer memory while another waits in NCCL would hang both)."""
        nbytes = x.numel() * x.element_size()
        types = (torch.bfloat16, torch.float16) if self.lamport is not None else (torch.bfloat16, torch.float32)
        return x.dtype in types and x.is_contiguous() and 0 < nbytes <= self.max_bytes and nbytes % 16 == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (``fits(x)`` must hold)."""
        if self.lamport is not None:
            self.lamport.all_reduce(x.view(-1))
            return x
        if x.data_ptr() % 16:  # a view off a 16-byte boundary: the kernel reads and writes 16-byte vectors
            return x.copy_(self.all_reduce(x.clone()))  # a fresh allocation is aligned
        flat = x.view(-1)
        shared = self.buffer[: flat.numel() * flat.element_size()].view(flat.dtype)
        # One kernel: the copy into the shared buffer, a barrier with the peers, their parts read and added into ``x``.
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(shared, flat, "sum", self.group_name, flat)
        return x


@dataclass(frozen=True)
class LamportState:
    """The Lamport kernel's arguments beside the buffers: every rank's buffer address, the call counter and the count
    of the call's programs that are done (on the device), and each region's size in elements."""

    ptrs: torch.Tensor  # int64 [world]
    state: torch.Tensor  # int64 [3]: the call counter, the call's programs done, the call before's element count
    rank: int
    world: int
    region: int

    def all_reduce(self, flat: torch.Tensor) -> None:
        n = flat.numel()
        _lamport_all_reduce[(triton.cdiv(n, LAMPORT_BLOCK),)](
            flat, self.ptrs, self.state, n, self.region, RANK=self.rank, WORLD=self.world, BLOCK=LAMPORT_BLOCK,
            num_warps=4)


if triton is not None:
    _SENTINEL = tl.constexpr(SENTINEL)

    @triton.jit
    def _lamport_all_reduce(x_ptr, ptrs_ptr, state_ptr, n, region, RANK: tl.constexpr, WORLD: tl.constexpr,
                            BLOCK: tl.constexpr):
        """``x[:n]`` summed over the ranks in place. A rank's buffer is three buffers of ``WORLD`` regions of ``region``
        elements, region r of a buffer holding rank r's part; ``state``: the call counter, the programs done, and the
        call before's element count (a smaller call after a larger one must still reset all that the larger wrote)."""
        offs = tl.max_contiguous(tl.multiple_of(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < n
        # The buffers' blocks are 16-byte aligned runs (a buffer is; a region's size and a program's first element are
        # multiples of 8 elements), which an address read from ``ptrs`` does not tell the compiler (``multiple_of``
        # below): without it every access moved 2 bytes.
        dtype = x_ptr.dtype.element_ty
        call = tl.load(state_ptr)
        # The call before's elements, what its buffer holds whatever this call's n is: a multiple of 8 (``fits``)
        n_before = tl.multiple_of(tl.load(state_ptr + 2), 8)
        use, used_before = call % 3, (call + 2) % 3
        own = tl.load(ptrs_ptr + RANK).to(tl.pointer_type(dtype))
        sentinel = tl.full([BLOCK], _SENTINEL, tl.int16).to(dtype, bitcast=True)
        lanes = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
        for start in range(tl.program_id(0) * BLOCK, n_before, tl.num_programs(0) * BLOCK):
            at = start + lanes  # the call before's buffer, all of it: the sentinel again, for the call after next
            for r in tl.static_range(WORLD):
                dst = tl.multiple_of(own + (used_before * WORLD + r) * region + at, 16)
                tl.store(dst, sentinel, mask=at < n_before)
        bits = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True)
        # -0 would read as not arrived: it is sent as +0
        part = tl.where(bits == _SENTINEL, tl.zeros_like(bits), bits).to(dtype, bitcast=True)
        for p in tl.static_range(WORLD):
            peer = tl.load(ptrs_ptr + p).to(tl.pointer_type(dtype))
            tl.store(tl.multiple_of(peer + (use * WORLD + RANK) * region + offs, 16), part, mask=mask)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):  # in rank order: every rank adds alike, and gets the same bits
            src = tl.multiple_of(own + (use * WORLD + r) * region + offs, 16)
            got = tl.load(src, mask=mask, other=0.0, volatile=True)
            waiting = tl.sum((got.to(tl.int16, bitcast=True) == _SENTINEL).to(tl.int32), axis=0)
            while waiting > 0:
                got = tl.load(src, mask=mask, other=0.0, volatile=True)
                waiting = tl.sum((got.to(tl.int16, bitcast=True) == _SENTINEL).to(tl.int32), axis=0)
            total += got.to(tl.float32)
        tl.store(x_ptr + offs, total.to(dtype), mask=mask)
        # Every program read the counter before any is done: the last one to finish moves it on for the next call.
        if tl.atomic_add(state_ptr + 1, 1) == tl.num_programs(0) - 1:
            tl.store(state_ptr, call + 1)
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr + 2, n)
