"""Small all-reduces over the TP ranks of one host through peer memory: each rank copies its partial sum into a
buffer every rank has mapped (torch symmetric memory), and one kernel reads every peer's copy over NVLink and adds
them in rank order (torch's ``one_shot_all_reduce``). A decode step's sums are 0.5-2 MiB each, two a layer, where
NCCL's latency dominates (docs/performance.md, "Two GPUs": 0.7-1.2 ms of 64 sums, against 0.5 ms this way). Larger
sums (prefill chunks) stay with NCCL.

No NVLink multicast (the machines keep it off): the one-shot kernel needs only peer loads. vLLM's custom all-reduce
is the same idea in its own kernel."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

#: Sums up to this many bytes go through peer memory: 256 decode rows of an 8192-wide model in bf16 (4 MiB).
DEFAULT_MAX_BYTES = 4 << 20


class PeerAllReduce:
    """One rank's symmetric buffer and the group it was exchanged with. Build it with ``connect``, on every rank
    of the group at once (the exchange is a collective)."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int):
        self.buffer = buffer  # uint8, mapped by every rank of the group
        self.group_name = group_name
        self.max_bytes = max_bytes

    @classmethod
    def connect(cls, tp, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> "PeerAllReduce | None":
        """The buffer, exchanged over ``tp``'s group (a ``TPGroup``) and checked with a sum every rank can verify;
        None (NCCL then takes every sum) where symmetric memory does not work here, saying why. Every rank must
        call it, and they agree: a rank whose check failed makes every rank return None (``TPGroup.failed_rank``)."""
        import torch.distributed as dist

        group_name = (tp.group if tp.group is not None else dist.group.WORLD).group_name
        error = None
        peer = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

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
        the kernel adds (float32 or bfloat16). From its shape alone, so every rank decides alike (a rank summing
        through peer memory while another waits in NCCL would hang both)."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % 16 == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (``fits(x)`` must hold)."""
        if x.data_ptr() % 16:  # a view off a 16-byte boundary: the kernel reads and writes 16-byte vectors
            return x.copy_(self.all_reduce(x.clone()))  # a fresh allocation is aligned
        flat = x.view(-1)
        shared = self.buffer[: flat.numel() * flat.element_size()].view(flat.dtype)
        # One kernel: the copy into the shared buffer, a barrier with the peers, their parts read and added into ``x``.
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(shared, flat, "sum", self.group_name, flat)
        return x
