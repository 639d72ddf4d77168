"""What mapping a run of pages costs on the GPU, piece by piece: the work ``MapKept`` (a cached prefix mapped into a
new slot) and a prefill's ``ensure`` do per 2 MiB physical page.

Over one reservation backed by the read-only zero page (as ``VirtualKVCache`` keeps unmapped space), for a run of
``--pages`` pages, median over ``--reps`` of microseconds per page: the attach as ``VirtualKVCache`` did it (unmap each
zero page, then one ``map_run``), with one ``cuMemUnmap`` over the zero pages instead, its parts alone (unmap, map,
access), a run over pages mapped elsewhere too (a shared prefix), two threads mapping halves at once, the detach
(unmap, zero page back), and the same bytes in fewer, larger physical allocations (``--groups``: pages an allocation
holds; a cuMemMap and a cuMemSetAccess each) -- whether the driver's cost goes with the allocations or the bytes --
and pages carved from one allocation (a cuMemMap each at its offset, one cuMemSetAccess over the run).

    python bench/vmm_run_costs.py [--pages 96] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import torch

import report
from kvmem.vmm.cuda import CudaVMM, cu


class Bench:
    def __init__(self, pages: int, reps: int, groups: list[int]):
        torch.zeros(1, device="cuda")
        self.vmm, self.n, self.reps = CudaVMM(0), pages, reps
        self.g = g = self.vmm.granularity
        base = self.vmm.reserve(4 * pages * g)
        self.zones = [base + i * pages * g for i in range(4)]
        for zone in self.zones:
            self.zero(zone)
        self.handles = [self.vmm.create(g) for _ in range(pages)]
        # pages an allocation holds -> the allocations holding the run's bytes
        self.grouped = {k: [self.vmm.create(k * g) for _ in range(pages // k)] for k in groups if pages % k == 0}
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
        for k, big in self.grouped.items():
            def unmap_groups(big=big, k=k):
                for i in range(len(big)):
                    check(cu.cuMemUnmap(z + i * k * g, k * g), "cuMemUnmap")
            self.time(f"map_run over unbacked space, allocations of {k} pages", lambda big=big, k=k:
                      vmm.map_run(z, k * g, big), setup=lambda: self.unmap_each(z),
                      undo=lambda unmap_groups=unmap_groups: (unmap_groups(), self.zero(z)))
        # (Last: where the driver refuses an offset, the zone is left as the failure left it.)
        # Pages carved from one allocation, each mapped at its own offset into it, in an order unlike the
        # allocation's (a pool's pages as slots come to hold them), then one cuMemSetAccess over the run: whether
        # the access call's cost goes with the allocations or with the mappings.
        carved = self.vmm.create(self.n * g)
        order = [(i * 37) % self.n for i in range(self.n)] if self.n % 37 else list(reversed(range(self.n)))

        def map_carved():
            for i, at in enumerate(order):
                check(cu.cuMemMap(z + i * g, g, at * g, carved, 0), "cuMemMap at an offset")
            access()
        try:
            self.time("map_run over unbacked space, pages carved from one allocation", map_carved,
                      setup=lambda: self.unmap_each(z), undo=lambda: self.restore(z))
        except RuntimeError as e:  # a driver that maps whole allocations only (offset 0)
            print(f"pages carved from one allocation: {e}")
            self.results["map_run over unbacked space, pages carved from one allocation"] = float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=96, help="pages in the run (a 3K-token prefix of llama-3-8b)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--groups", type=int, nargs="*", default=[4, 16, 96],
                        help="pages an allocation holds, for the rows of fewer, larger allocations")
    parser.add_argument("--name", default="vmm_run_costs")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    args = parser.parse_args()
    bench = Bench(args.pages, args.reps, args.groups)
    bench.run()
    rows = [[name, us] for name, us in bench.results.items()]
    report.write(args.name, ["what (2 MiB pages)", "us / page"], rows,
                 {"pages": args.pages, "reps": args.reps, "groups": args.groups,
                  "results_us_per_page": bench.results}, args.out)


if __name__ == "__main__":
    main()
