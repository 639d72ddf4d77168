"""What mapping a run of pages costs on the GPU, piece by piece: the work ``MapKept`` (a cached prefix mapped into a
new slot) and a prefill's ``ensure`` do per 2 MiB physical page.

Over one reservation backed by the read-only zero page (as ``VirtualKVCache`` keeps unmapped space), for a run of
``--pages`` pages, median over ``--reps`` of microseconds per page: the attach as ``VirtualKVCache`` did it (unmap each
zero page, then one ``map_run``), with one ``cuMemUnmap`` over the zero pages instead, its parts alone (unmap, map,
access), a run over pages mapped elsewhere too (a shared prefix), two threads mapping halves at once, and the detach
(unmap, zero page back).

    python bench/vmm_run_costs.py [--pages 96] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

import report
from kvmem.vmm.cuda import CudaVMM, cu


class Bench:
    def __init__(self, pages: int, reps: int):
        torch.zeros(1, device="cuda")
        self.vmm, self.n, self.reps = CudaVMM(0), pages, reps
        self.g = g = self.vmm.granularity
        base = self.vmm.reserve(4 * pages * g)
        self.zones = [base + i * pages * g for i in range(4)]
        for zone in self.zones:
            self.zero(zone)
        self.handles = [self.vmm.create(g) for _ in range(pages)]
        self.results: dict[str, float] = {}

    def zero(self, zone: int) -> None:
        for i in range(self.n):
            self.vmm.map_zero(zone + i * self.g, self.g)

    def unmap_each(self, zone: int) -> None:
        for i in range(self.n):
            self.vmm.unmap(zone + i * self.g, self.g)

    def restore(self, zone: int) -> None:
        self.unmap_each(zone)
        self.zero(zone)

    def time(self, name: str, body, setup=lambda: None, undo=lambda: None) -> None:
        samples = []
        for _ in range(self.reps):
            setup()
            start = time.perf_counter()
            body()
            samples.append(time.perf_counter() - start)
            undo()
        self.results[name] = statistics.median(samples) * 1e6 / self.n

    def run(self) -> None:
        vmm, g, z, hs = self.vmm, self.g, self.zones[0], self.handles

        def check(result, what):
            if (result[0] if isinstance(result, tuple) else result) != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"{what} failed: {result}")

        def maps_only():
            for i, h in enumerate(hs):
                check(cu.cuMemMap(z + i * g, g, 0, h, 0), "cuMemMap")

        def access():
            check(cu.cuMemSetAccess(z, self.n * g, [vmm._rw], 1), "cuMemSetAccess")

        def halves():
            half = self.n // 2

            def one(k):
                start = self.zones[2] + k * half * g
                for i in range(half):
                    vmm.unmap(start + i * g, g)
                vmm.map_run(start, g, hs[k * half:(k + 1) * half])
            threads = [threading.Thread(target=one, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        self.time("attach: unmap each zero page, map_run", lambda: (self.unmap_each(z), vmm.map_run(z, g, hs)),
                  undo=lambda: self.restore(z))
        self.time("attach: one unmap over the zero pages, map_run",
                  lambda: (check(cu.cuMemUnmap(z, self.n * g), "cuMemUnmap"), vmm.map_run(z, g, hs)),
                  undo=lambda: self.restore(z))
        self.time("unmap a zero page", lambda: self.unmap_each(z), undo=lambda: self.zero(z))
        self.time("map a zero page (map + access)", lambda: self.zero(z), setup=lambda: self.unmap_each(z))
        self.time("map_run over unbacked space", lambda: vmm.map_run(z, g, hs), setup=lambda: self.unmap_each(z),
                  undo=lambda: self.restore(z))
        self.unmap_each(self.zones[1])
        vmm.map_run(self.zones[1], g, hs)
        self.time("map_run over unbacked space, pages mapped elsewhere too", lambda: vmm.map_run(z, g, hs),
                  setup=lambda: self.unmap_each(z), undo=lambda: self.restore(z))
        self.time("cuMemMap alone", maps_only, setup=lambda: self.unmap_each(z),
                  undo=lambda: (access(), self.restore(z)))
        self.time("one cuMemSetAccess over the run", access, setup=lambda: (self.unmap_each(z), maps_only()),
                  undo=lambda: self.restore(z))
        self.time("two threads, half the run each (attach as today)", halves, undo=lambda: self.restore(self.zones[2]))
        self.time("detach: unmap, zero page back", lambda: self.restore(z),
                  setup=lambda: (self.unmap_each(z), vmm.map_run(z, g, hs)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=96, help="pages in the run (a 3K-token prefix of llama-3-8b)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--name", default="vmm_run_costs")
    args = parser.parse_args()
    bench = Bench(args.pages, args.reps)
    bench.run()
    rows = [[name, us] for name, us in bench.results.items()]
    report.write(args.name, ["what (2 MiB pages)", "us / page"], rows,
                 {"pages": args.pages, "reps": args.reps, "results_us_per_page": bench.results})


if __name__ == "__main__":
    main()
