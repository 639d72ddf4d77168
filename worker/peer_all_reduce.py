"""Small all-reduces over the TP ranks of one host through peer memory: each rank copies its partial sum into a
buffer every rank has mapped (torch symmetric memory), and one kernel reads every peer's copy over NVLink and adds
them in rank order (torch's ``one_shot_all_reduce``). A decode step's sums are 0.5-2 MiB each, two a layer, where
NCCL's latency dominates (docs/performance.md, "Two GPUs": 0.7-1.2 ms of 64 sums, against 0.5 ms this way). Larger
sums (prefill chunks) stay with NCCL.

No NVLink multicast (the machines keep it off): the one-shot kernel needs only peer loads. vLLM's custom all-reduce
is the same idea in its own kernel.

16-bit sums go by default through a kernel of ours that needs no barrier (``VATTN_PEER_ALL_REDUCE=one_shot`` picks
torch's), TensorRT-LLM's Lamport scheme: each rank writes its part into every other rank's buffer, and
each adds the parts in rank order as they arrive (its own from its registers) -- a value that is not the sentinel
(negative zero, which no part carries: a part's -0 is sent as +0) has arrived. The one-shot kernel's barrier is a round
trip between the GPUs before any byte moves; here the parts move at once and the wait is for them. Three buffers take
the calls in turn, and a call, once its part is sent, sets the one the call before used back to the sentinel: no rank
writes into it again before this rank's next call has sent its part, which comes after this call on this rank's stream
(all of it: the call before's element count is kept beside the counter, since a smaller sum may follow a larger one).
Which buffer a call uses is a counter on the device, so CUDA graphs replay the sums as eager steps run them; the sums
of a group must therefore come from one stream at a time, in the same order on every rank (as a step's layers make
them).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from worker.kernels import RMS_NORM_WARPS

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
MAX_FUSED_HIDDEN = 8192  # the widest row the fused sum + norm kernel takes (a program a row)


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
        ``kernel``: "one_shot" (torch's) or "lamport" (ours); None: ``VATTN_PEER_ALL_REDUCE``, else "lamport" where
        Triton is installed (on 2xH200 a TP=2 decode step in CUDA graphs took 8.47 ms with it against 8.87 with
        torch's, and it fuses the norms after the sums; docs/performance.md, "Two GPUs")."""
        import torch.distributed as dist

        kernel = kernel or default_kernel()
        if kernel not in KERNELS:
            raise ValueError(f"peer all-reduce kernel must be one of {KERNELS}, got {kernel!r} (VATTN_PEER_ALL_REDUCE)")
        group_name = (tp.group if tp.group is not None else dist.group.WORLD).group_name
        lamport = kernel == "lamport"
        # Every rank answers after each step, so that one whose step failed (no Triton, no memory, a check after the
        # exchange) never leaves the others in the next step's collective: then NCCL takes every sum, on every rank.
        # A failure inside the exchange itself (no peer access, an old driver) must come on every rank at once, as it
        # does where the GPUs cannot share memory; one rank's alone would leave the others waiting in it.
        buffer = _on_every_rank(tp, device, _allocate, tp.size, device, max_bytes, lamport)
        if buffer is None:
            return None
        peer = _on_every_rank(tp, device, _exchange, buffer, tp, group_name, device, max_bytes, lamport)
        if peer is None or _on_every_rank(tp, device, _probe, peer, tp, device) is None:
            return None
        return peer

    @property
    def sums_in_float32(self) -> bool:
        """Whether the parts are added in float32 and rounded once (the Lamport kernel), not in their own type."""
        return self.lamport is not None

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through peer memory: contiguous, small enough, a whole number of 16-byte vectors, a type
        the kernel adds (float32 or bfloat16; the Lamport kernel's: bfloat16 or float16). From its shape alone, so
        every rank decides alike (a rank summing through peer memory while another waits in NCCL would hang both)."""
        nbytes = x.numel() * x.element_size()
        types = (torch.bfloat16, torch.float16) if self.lamport is not None else (torch.bfloat16, torch.float32)
        return x.dtype in types and x.is_contiguous() and 0 < nbytes <= self.max_bytes and nbytes % 16 == 0

    def fuses(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether the sum of ``x`` and the residual add and RMSNorm after it run as one kernel (the Lamport kernel's):
        ``fits(x)``, rows of a multiple of 8 elements up to ``MAX_FUSED_HIDDEN``, a residual of ``x``'s shape and type.
        From shapes alone, as ``fits``."""
        return (self.lamport is not None and self.fits(x) and x.dim() == 2 and x.shape[1] % 8 == 0
                and x.shape[1] <= MAX_FUSED_HIDDEN and residual.shape == x.shape and residual.dtype == x.dtype
                and residual.is_contiguous())

    def all_reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, rms_norm(h))`` with ``h`` = ``x`` summed over the group plus ``residual``, in one kernel (``fuses``
        must hold): ``worker.kernels.rms_norm(sum, weight, eps, residual)``'s result, to the bit."""
        h, out = torch.empty_like(x), torch.empty_like(x)
        self.lamport.all_reduce_norm(x, residual, weight, eps, h, out)
        return h, out

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


def default_kernel() -> str:
    """The kernel ``PeerAllReduce.connect`` takes when not told: ``VATTN_PEER_ALL_REDUCE``, else "lamport" where Triton
    is installed, else torch's "one_shot"."""
    return os.environ.get("VATTN_PEER_ALL_REDUCE") or ("lamport" if triton is not None else "one_shot")


def _on_every_rank(tp, device: torch.device, step, *args):
    """``step(*args)``'s result where it returned on every rank of ``tp``, else None on every rank, this rank's error
    logged (every rank must call it with its step, as with any collective: ``TPGroup.failed_rank``)."""
    try:
        result, error = step(*args), None
    except Exception as exc:
        result, error = None, exc
    if tp.failed_rank(error is not None, device) is None:
        return result
    if error is not None:
        logger.warning("all-reduces stay on NCCL: symmetric memory over the TP group failed (%s: %s)",
                       type(error).__name__, error)
    return None


def _allocate(world: int, device: torch.device, max_bytes: int, lamport: bool) -> torch.Tensor:
    """This rank's symmetric buffer: one of ``max_bytes``, or the Lamport kernel's three buffers of a region per rank,
    each element the sentinel. This rank alone: what fails here may fail on one rank only."""
    import torch.distributed._symmetric_memory as symm_mem

    if lamport and triton is None:
        raise RuntimeError("the Lamport kernel needs Triton")
    if lamport and max_bytes % 16:
        raise RuntimeError(f"the Lamport kernel needs 16-byte regions (max_bytes={max_bytes})")
    buffer = symm_mem.empty(3 * world * max_bytes if lamport else max_bytes, dtype=torch.uint8, device=device)
    if lamport:
        buffer.view(torch.int16).fill_(SENTINEL)
    return buffer


def _exchange(buffer: torch.Tensor, tp, group_name: str, device: torch.device, max_bytes: int,
              lamport: bool) -> PeerAllReduce:
    """The buffers exchanged (a collective), then this rank's own checks."""
    import torch.distributed._symmetric_memory as symm_mem

    handle = symm_mem.rendezvous(buffer, group_name)
    if not lamport:
        return PeerAllReduce(buffer, group_name, max_bytes)
    if handle.buffer_ptrs[tp.rank] != buffer.data_ptr():
        raise RuntimeError("the Lamport kernel needs its buffer at its own address")
    state = LamportState(torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device),
                         torch.zeros(3, dtype=torch.int64, device=device), tp.rank, tp.size, max_bytes // 2)
    return PeerAllReduce(buffer, group_name, max_bytes, state)


def _probe(peer: PeerAllReduce, tp, device: torch.device) -> bool:
    """A sum every rank can verify: each adds rank + 1, n(n+1)/2 exactly (float32, or bfloat16 for the Lamport kernel,
    which sums 16-bit types). After a barrier: every rank's buffers hold the sentinel before any rank sends a part."""
    tp.barrier(device)
    x = torch.full((1024,), float(tp.rank + 1), dtype=torch.bfloat16 if peer.sums_in_float32 else torch.float32,
                   device=device)
    peer.all_reduce(x)
    if not bool((x == tp.size * (tp.size + 1) / 2).all()):
        raise RuntimeError(f"a probe sum over {tp.size} ranks came out as {x[0].item()}")
    return True


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

    def all_reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        h: torch.Tensor, out: torch.Tensor) -> None:
        rows, hidden = x.shape
        _lamport_all_reduce_norm[(rows,)](
            x, residual, weight, h, out, self.ptrs, self.state, x.numel(), hidden, self.region, eps, RANK=self.rank,
            WORLD=self.world, BLOCK=triton.next_power_of_2(hidden), num_warps=RMS_NORM_WARPS)  # rms_norm's bits


if triton is not None:
    from worker.kernels import add_residual, rms_norm_row

    _SENTINEL = tl.constexpr(SENTINEL)

    # A rank's buffer is three buffers of ``WORLD`` regions of ``region`` elements, region r of a buffer holding rank
    # r's part (a rank's own region stays the sentinel: its part stays in registers); ``state``: the call counter, the
    # call's programs done, and the call before's element count (a smaller call after a larger one must still reset all
    # that the larger wrote). The buffers' blocks are 16-byte aligned runs (a buffer is; a region's size, a program's
    # first element and a row are multiples of 8 elements), which an address read from ``ptrs`` does not tell the
    # compiler (the ``multiple_of``s): without them every access moved 2 bytes.

    @triton.jit
    def _lamport_reset(own, call, state_ptr, region, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
        """Set the parts the call before received back to the sentinel, for the call after next. After this call's
        part has gone: no rank writes into that buffer before this rank's next call has sent its part."""
        n_before = tl.multiple_of(tl.load(state_ptr + 2), 8)  # a multiple of 8 (``fits``)
        used_before = (call + 2) % 3
        sentinel = tl.full([BLOCK], _SENTINEL, tl.int16).to(own.dtype.element_ty, bitcast=True)
        lanes = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
        start = tl.program_id(0) * BLOCK
        while start < n_before:  # not a range(): Triton 3.6's interpreter takes no loaded bound there
            at = start + lanes
            for r in tl.static_range(WORLD):
                if r != RANK:
                    dst = tl.multiple_of(own + (used_before * WORLD + r) * region + at, 16)
                    tl.store(dst, sentinel, mask=at < n_before)
            start += tl.num_programs(0) * BLOCK

    @triton.jit
    def _lamport_sum(x_ptr, offs, mask, ptrs_ptr, state_ptr, region, RANK: tl.constexpr, WORLD: tl.constexpr,
                     BLOCK: tl.constexpr):
        """This rank's part of ``x[offs]`` into every other rank's buffer, then every rank's part, the others' as they
        arrive, added in rank order (every rank adds alike, and gets the same bits), in float32; and this call's
        number. The part goes out first; the reset of the call before's buffer runs while it travels, and this rank's
        own part never leaves its registers."""
        dtype = x_ptr.dtype.element_ty
        call = tl.load(state_ptr)
        use = call % 3
        bits = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True)
        # -0 would read as not arrived: it is sent as +0
        part = tl.where(bits == _SENTINEL, tl.zeros_like(bits), bits).to(dtype, bitcast=True)
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer = tl.load(ptrs_ptr + p).to(tl.pointer_type(dtype))
                tl.store(tl.multiple_of(peer + (use * WORLD + RANK) * region + offs, 16), part, mask=mask)
        own = tl.load(ptrs_ptr + RANK).to(tl.pointer_type(dtype))
        _lamport_reset(own, call, state_ptr, region, RANK, WORLD, BLOCK)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                total += part.to(tl.float32)
            else:
                src = tl.multiple_of(own + (use * WORLD + r) * region + offs, 16)
                got = tl.load(src, mask=mask, other=0.0, volatile=True)
                waiting = tl.sum((got.to(tl.int16, bitcast=True) == _SENTINEL).to(tl.int32), axis=0)
                while waiting > 0:
                    got = tl.load(src, mask=mask, other=0.0, volatile=True)
                    waiting = tl.sum((got.to(tl.int16, bitcast=True) == _SENTINEL).to(tl.int32), axis=0)
                total += got.to(tl.float32)
        return total, call

    @triton.jit
    def _lamport_end(state_ptr, call, n):
        """Every program read the counter before any is done: the last one to finish moves it on for the next call."""
        if tl.atomic_add(state_ptr + 1, 1) == tl.num_programs(0) - 1:
            tl.store(state_ptr, call + 1)
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr + 2, n)

    @triton.jit
    def _lamport_all_reduce(x_ptr, ptrs_ptr, state_ptr, n, region, RANK: tl.constexpr, WORLD: tl.constexpr,
                            BLOCK: tl.constexpr):
        """``x[:n]`` summed over the ranks in place, ``BLOCK`` elements a program."""
        offs = tl.max_contiguous(tl.multiple_of(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < n
        total, call = _lamport_sum(x_ptr, offs, mask, ptrs_ptr, state_ptr, region, RANK, WORLD, BLOCK)
        tl.store(x_ptr + offs, total.to(x_ptr.dtype.element_ty), mask=mask)
        _lamport_end(state_ptr, call, n)

    @triton.jit
    def _lamport_all_reduce_norm(x_ptr, r_ptr, w_ptr, h_ptr, out_ptr, ptrs_ptr, state_ptr, n, hidden, region, eps,
                                 RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
        """A row a program: the row of ``x`` summed over the ranks, plus the residual's row into ``h``, and ``h``'s
        RMSNorm into ``out`` -- what the sum then ``worker.kernels.rms_norm`` give, to the bit (the sum rounded to the
        model's dtype first, as the sum's output is)."""
        dtype = x_ptr.dtype.element_ty
        cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = cols < hidden
        offs = tl.multiple_of(tl.program_id(0).to(tl.int64) * hidden, 8) + cols
        x, call = _lamport_sum(x_ptr, offs, mask, ptrs_ptr, state_ptr, region, RANK, WORLD, BLOCK)
        x = x.to(dtype)
        h = add_residual(x, tl.load(r_ptr + offs, mask=mask, other=0.0))
        tl.store(h_ptr + offs, h, mask=mask)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + offs, rms_norm_row(h, w, hidden, eps), mask=mask)
        _lamport_end(state_ptr, call, n)
