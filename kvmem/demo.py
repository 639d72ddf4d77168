"""A short tour of the virtual-memory KV cache: ``python -m kvmem.demo [--device cuda]``.

Three requests grow page by page (mapped ahead by the AsyncMapper), one forks another's prompt by
sharing pages, the fork writes and gets its own copy, requests finish, and memory goes back.
"""

from __future__ import annotations

import argparse

import torch

from kvmem import AsyncMapper, KVCacheSpec, MappingPlan, VirtualKVCache, default_vmm

MiB = 1 << 20


def show(cache: VirtualKVCache, what: str) -> None:
    s = cache.stats()
    print(
        f"{what:<44} mapped {s.mapped_bytes / MiB:7.2f} MiB  used {s.used_bytes / MiB:7.2f} MiB  "
        f"free pages {s.free_pages:4d}  slots {s.slots_in_use}  frag {s.fragmentation:5.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    vmm = default_vmm(args.device)
    page = 2 * MiB
    # 8 layers of Llama-3-8B's attention shape (8 KV heads, head dim 128) in the mega layout.
    spec = KVCacheSpec(8, 8, 128, torch.bfloat16, max_slots=8, max_tokens=4096, layout="mega", page_size=page)
    with VirtualKVCache(spec, pool_bytes=128 * page, vmm=vmm) as cache, AsyncMapper(cache) as mapper:
        print(f"{type(vmm).__name__} on {cache.device}: reserved {spec.reserved_bytes / MiB:.0f} MiB virtual, "
              f"{spec.page_size // spec.token_bytes} tokens per {page // 1024} KiB page\n")
        show(cache, "start: nothing mapped")
        slots = [cache.alloc_slot(n) for n in (300, 900, 1500)]
        for step, tokens in enumerate((64, 300, 900)):
            plan = mapper.submit(MappingPlan({s: min(tokens * (i + 1), spec.max_tokens) for i, s in enumerate(slots)}))
            mapper.wait(plan)  # in the engine, the model's step runs between submit and wait
            show(cache, f"step {step}: requests hold {[cache.num_tokens(s) for s in slots]}")
        cache.k(0)[slots[0], :64] = 1.0
        fork = cache.alloc_slot()
        cache.share_prefix(slots[0], fork, 64)
        show(cache, "fork request 0's first 64 tokens (shared)")
        cache.ensure(fork, 80)
        cache.k(0)[fork, 64:80] = 2.0
        assert float(cache.k(0)[slots[0], 70, 0, 0]) != 2.0
        show(cache, "fork appends: copy-on-write of one page")
        for s in (*slots, fork):
            cache.free_slot(s)
        show(cache, "all finished: pages stay mapped for reuse")
        freed = cache.reclaim(10**9)
        show(cache, f"reclaim: {freed} pages back to the pool")
        released = cache.shrink(64 * page)
        show(cache, f"shrink: {released / MiB:.0f} MiB back to the system")
        print(f"\nmap latency p50 {cache.stats().map_latency_p50_us:.1f} us per page group, "
              f"stall {cache.stats().stall_seconds * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
