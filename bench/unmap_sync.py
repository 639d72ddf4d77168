"""Whether the CUDA driver's map and unmap calls wait for work queued on the device: each call timed on an idle
device and while a ~0.3 s kernel runs (one that touches none of the pages), on pages that no kernel reads.

    python bench/unmap_sync.py [--pages 64] [--out results/]

A call that takes the kernel's time while it runs waits for the device: done between steps, it serialises the host
with the step in flight (``kvmem.slots``: unmaps are deferred past the step that may read their pages).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import report
from kvmem.vmm.cuda import CudaVMM

PAGE = 2 << 20


def timed(call, *args) -> float:
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


def measure(vmm: CudaVMM, pages: int, busy: bool) -> dict:
    """Seconds of one run's map_run, then of its unmap, over ``pages`` pages; ``busy``: while a kernel runs."""
    va = vmm.reserve(pages * PAGE)
    handles = [vmm.create(PAGE) for _ in range(pages)]
    try:
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(600_000_000)  # ~0.3 s on an H100
        mapped = timed(vmm.map_run, va, PAGE, handles)
        unmapped = timed(vmm.unmap, va, pages * PAGE)
        waited = timed(torch.cuda.synchronize)
        return {"busy": busy, "pages": pages, "map_run_s": mapped, "unmap_s": unmapped, "then_sync_s": waited}
    finally:
        for h in handles:
            vmm.release(h)
        vmm.free(va, pages * PAGE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    args = parser.parse_args()
    vmm = CudaVMM()
    measure(vmm, args.pages, False)  # the driver's first calls
    runs = [measure(vmm, args.pages, busy) for busy in (False, True, False, True)]
    rows = [[r["busy"], r["pages"], 1e3 * r["map_run_s"], 1e3 * r["unmap_s"], 1e3 * r["then_sync_s"]] for r in runs]
    report.write("unmap_sync", ["kernel running", "pages", "map_run ms", "unmap ms", "then synchronize ms"], rows,
                 {"runs": runs}, args.out)
    vmm.close()


if __name__ == "__main__":
    main()
