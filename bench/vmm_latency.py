"""CUDA VMM latency: raw driver calls against one page through our layer (VirtualKVCache.ensure).

Per page size (2, 4, 8 MiB): median and p99 microseconds per call of cuMemCreate / cuMemMap /
cuMemSetAccess / cuMemUnmap / cuMemRelease, then the cost of one ``ensure()`` that backs one more page of
a slot (a K and a V page in the mega layout) next to the same driver calls made bare, with and without
the read-only zero page over unmapped space. Also the start-up cost of zero-backing a reservation.

    python bench/vmm_latency.py [--pages 256] [--out bench/results]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import report
from kvmem import KVCacheSpec, VirtualKVCache
from kvmem.vmm.cuda import CudaVMM, cu

MiB = 1 << 20


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "median_us": statistics.median(ordered),
        "p99_us": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "samples_us": [round(s, 2) for s in samples],
    }


def timed(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - start) * 1e6)
    return out


def raw_calls(vmm: CudaVMM, page: int, n: int) -> dict:
    """Each driver call on its own, ``n`` pages, through cuda-bindings directly."""
    check = vmm._check
    va = int(check(cu.cuMemAddressReserve(page * n, 0, 0, 0), "cuMemAddressReserve"))
    handles: list = [None] * n
    desc = [vmm._rw]
    out = {
        "create": timed(lambda i: handles.__setitem__(i, check(cu.cuMemCreate(page, vmm._prop, 0), "cuMemCreate")), n),
        "map": timed(lambda i: check(cu.cuMemMap(va + i * page, page, 0, handles[i], 0), "cuMemMap"), n),
        "set_access": timed(lambda i: check(cu.cuMemSetAccess(va + i * page, page, desc, 1), "cuMemSetAccess"), n),
        "unmap": timed(lambda i: check(cu.cuMemUnmap(va + i * page, page), "cuMemUnmap"), n),
        # the same handles a second time: what a first map pays once (a fresh allocation's first backing)
        "map_again": timed(lambda i: check(cu.cuMemMap(va + i * page, page, 0, handles[i], 0), "cuMemMap"), n),
        "set_access_again": timed(lambda i: check(cu.cuMemSetAccess(va + i * page, page, desc, 1), "cuMemSetAccess"), n),
        "unmap_again": timed(lambda i: check(cu.cuMemUnmap(va + i * page, page), "cuMemUnmap"), n),
        "release": timed(lambda i: check(cu.cuMemRelease(handles[i]), "cuMemRelease"), n),
    }
    check(cu.cuMemAddressFree(va, page * n), "cuMemAddressFree")
    return out


def raw_group(vmm: CudaVMM, page: int, n: int, buffers: int, zero: bool) -> list[float]:
    """What one ensure() of one page must do at the driver, timed bare: per buffer (unmap the zero
    page,) map, set access."""
    check = vmm._check
    vas = [int(check(cu.cuMemAddressReserve(page * n, 0, 0, 0), "cuMemAddressReserve")) for _ in range(buffers)]
    handles = [[check(cu.cuMemCreate(page, vmm._prop, 0), "cuMemCreate") for _ in range(buffers)] for _ in range(n)]
    if zero:
        for va in vas:
            for i in range(n):
                vmm.map_zero(va + i * page, page)

    def one(i: int) -> None:
        for b, va in enumerate(vas):
            addr = va + i * page
            if zero:
                check(cu.cuMemUnmap(addr, page), "cuMemUnmap")
            check(cu.cuMemMap(addr, page, 0, handles[i][b], 0), "cuMemMap")
            check(cu.cuMemSetAccess(addr, page, [vmm._rw], 1), "cuMemSetAccess")

    samples = timed(one, n)
    for i in range(n):
        for b, va in enumerate(vas):
            check(cu.cuMemUnmap(va + i * page, page), "cuMemUnmap")
            check(cu.cuMemRelease(handles[i][b]), "cuMemRelease")
    for va in vas:
        check(cu.cuMemAddressFree(va, page * n), "cuMemAddressFree")
    return samples


def spec_for(page: int, pages_per_slot: int) -> KVCacheSpec:
    # Llama-3-8B's KV shape in the mega layout: 32 layers x 8 heads x 128 x bf16 = 64 KiB per token.
    probe = KVCacheSpec(32, 8, 128, torch.bfloat16, 1, 1, "mega", page)
    return KVCacheSpec(32, 8, 128, torch.bfloat16, 2, pages_per_slot * page // probe.token_bytes, "mega", page)


def layer_ensure(vmm: CudaVMM, page: int, n: int, zero: bool) -> dict:
    """ensure() of one more page, interleaved with the same driver calls made bare at the same kind of
    place (the next slot of the same buffers, pages from the same pool), then reclaim() per page."""
    spec = spec_for(page, n)
    start = time.perf_counter()
    cache = VirtualKVCache(spec, 2 * n * spec.num_buffers * page, vmm, zero_unmapped=zero)
    setup_s = time.perf_counter() - start
    slot, other = cache.alloc_slot(), cache.alloc_slot()
    tpp = page // spec.token_bytes
    bare_pages = cache._pool.take(n * spec.num_buffers)
    check = vmm._check

    def bare(i: int) -> None:
        for b in range(spec.num_buffers):
            va = cache._va(b, other, i)
            if zero:
                check(cu.cuMemUnmap(va, page), "cuMemUnmap")
            check(cu.cuMemMap(va, page, 0, cache._pool.handle(bare_pages[i * spec.num_buffers + b]), 0), "cuMemMap")
            check(cu.cuMemSetAccess(va, page, [vmm._rw], 1), "cuMemSetAccess")

    ensure, direct = [], []
    for i in range(n):
        pair = [(ensure, lambda: cache.ensure(slot, (i + 1) * tpp)), (direct, lambda: bare(i))]
        for samples, fn in pair if i % 2 else pair[::-1]:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e6)
    for i in range(n):
        for b in range(spec.num_buffers):
            va = cache._va(b, other, i)
            vmm.unmap(va, page)
            if zero:
                vmm.map_zero(va, page)
    cache._pool.give(bare_pages)
    cache.free_slot(slot)
    reclaim = timed(lambda i: cache.reclaim(spec.num_buffers), n)
    assert cache.stats().mapped_bytes == 0
    cache.free_slot(other)
    cache.close()
    return {"ensure": ensure, "bare": direct, "reclaim": reclaim, "setup_s": setup_s, "reserved_bytes": spec.reserved_bytes}


def run_ensure(vmm: CudaVMM, page: int, run: int, zero: bool, reps: int = 8) -> list[float]:
    """µs per page of one ``ensure()`` backing ``run`` pages at once (a prefill chunk's, a cached prefix's): one
    access call per buffer for the run (``VMM.map_run``); the slot is reclaimed between repetitions."""
    spec = spec_for(page, run)
    cache = VirtualKVCache(spec, run * spec.num_buffers * page, vmm, zero_unmapped=zero)
    tokens = run * page // spec.token_bytes
    out = []
    for _ in range(reps):
        slot = cache.alloc_slot()
        t = time.perf_counter()
        cache.ensure(slot, tokens)
        out.append((time.perf_counter() - t) * 1e6 / run)
        cache.free_slot(slot)
        cache.reclaim(run * spec.num_buffers)
    cache.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--run", type=int, default=64, help="pages one ensure() backs at once for the run column")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    parser.add_argument("--name", default="vmm_latency", help="results file name (without .json)")
    args = parser.parse_args()
    vmm = CudaVMM(0)
    n = args.pages
    raw_calls(vmm, 2 * MiB, 16)  # warm-up: driver paths, first-touch costs
    layer_ensure(vmm, 2 * MiB, 16, zero=False)
    rows, data = [], {"pages_per_run": n, "results": {}}
    for mib in args.sizes_mib:
        page = mib * MiB
        raw = {name: summary(s) for name, s in raw_calls(vmm, page, n).items()}
        result: dict = {"raw": raw}
        for zero in (False, True):
            ours = layer_ensure(vmm, page, n, zero)
            bare = summary(ours["bare"])
            fresh = summary(raw_group(vmm, page, n, buffers=2, zero=zero))
            key = "zero_page" if zero else "no_zero_page"
            result[key] = {
                "ensure": summary(ours["ensure"]),
                "reclaim": summary(ours["reclaim"]),
                "bare_driver_same_calls": bare,
                "bare_driver_fresh_reservation": fresh,
                # Paired: each ensure() against the bare calls timed next to it (order alternates).
                "overhead_us_per_ensure": statistics.median(e - b for e, b in zip(ours["ensure"], ours["bare"])),
                "setup_s": ours["setup_s"],
                "setup_us_per_page": ours["setup_s"] * 1e6 * page / ours["reserved_bytes"],
                "reserved_bytes": ours["reserved_bytes"],
                "ensure_run_us_per_page": summary(run_ensure(vmm, page, args.run, zero)),
            }
        data["results"][f"{mib}MiB"] = result
        row = [f"{mib} MiB"] + [raw[c]["median_us"] for c in ("create", "map", "set_access", "unmap", "release")]
        row += [raw[c]["p99_us"] for c in ("map", "set_access")]
        for key in ("no_zero_page", "zero_page"):
            r = result[key]
            row += [r["ensure"]["median_us"], r["bare_driver_same_calls"]["median_us"], r["overhead_us_per_ensure"],
                    r["bare_driver_fresh_reservation"]["median_us"]]
        row.append(result["zero_page"]["setup_us_per_page"] - result["no_zero_page"]["setup_us_per_page"])
        row += [result[key]["ensure_run_us_per_page"]["median_us"] for key in ("no_zero_page", "zero_page")]
        rows.append(row)
    headers = ["page", "create", "map", "set_acc", "unmap", "release", "map p99", "set_acc p99",
               "ensure", "bare 2x(map+acc)", "overhead", "bare fresh VA",
               "ensure+zero", "bare 2x(unmap+map+acc)", "overhead+zero", "bare fresh VA+zero", "zero setup/page",
               f"ensure of {args.run} / page", "+zero"]
    print("median µs per call (p99 where named); ensure() backs one page in K and in V (mega layout);")
    print("'bare' = the same driver calls without our layer, interleaved with ensure() in the same buffers;")
    print("overhead = median over pairs of (ensure - bare); 'fresh VA' = bare calls in a new reservation")
    report.write(args.name, headers, rows, data, args.out)
    vmm.close()


if __name__ == "__main__":
    main()
