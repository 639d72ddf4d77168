"""Decode attention over each KV layout: FA2 read in place from the virtual cache (mega / per_layer, by
page size) against the same kernel over plain torch allocations, and the paged gather path; where the
flash-attn package is installed, its ``flash_attn_with_kvcache`` over the same virtual caches.

Isolates the kernel from the engine: B sequences with lengths uniform in [lo, hi], one decode query each,
Llama-3-8B attention shape (32 query heads, 8 KV heads, head dim 128, 32 layers), bf16; median of CUDA-event
timings of one layer's FA2 call (layer 17, the middle of the stack), rotating over 4 layers' worth of inputs.

    python bench/attention_layout.py [--batch 128] [--lo 512] [--hi 2304]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
from pathlib import Path

import torch

import report
from timing import time_ms
from kvmem import KVCacheSpec, PagedKVCache, VirtualKVCache, paged_spec
from kvmem.vmm.cuda import CudaVMM
from worker.config import PRESETS

_LLAMA3 = PRESETS["llama-3-8b"]
LAYERS, HQ, HKV, D = _LLAMA3.num_layers, _LLAMA3.num_heads, _LLAMA3.num_kv_heads, _LLAMA3.head_dim
MiB = 1 << 20
fa2 = torch.ops.aten._flash_attention_forward


def virtual_case(layout: str, page: int, lens: list[int], max_tokens: int, vmm: CudaVMM, kernel: str = "fa2") -> float:
    """``kernel``: ``fa2`` (torch's, varlen over the flattened rows) or ``flash_attn`` (the package's
    ``flash_attn_with_kvcache`` over ``[slot, token, H, D]`` with ``cache_batch_idx``)."""
    spec = KVCacheSpec(LAYERS, HKV, D, torch.bfloat16, len(lens), max_tokens, layout, page)
    pool = sum(spec.physical_bytes_for(n) for n in lens)
    with VirtualKVCache(spec, pool, vmm) as cache:
        slots = [cache.alloc_slot() for _ in lens]
        for s, n in zip(slots, lens):
            cache.ensure(s, n)
            for layer in range(LAYERS):
                cache.k(layer)[s, :n].normal_()
                cache.v(layer)[s, :n].normal_()
        q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
        starts = torch.tensor([s * spec.slot_tokens for s in slots] + [len(lens) * spec.slot_tokens], device="cuda", dtype=torch.int32)
        used = torch.tensor(lens, device="cuda", dtype=torch.int32)
        if kernel == "flash_attn":
            from flash_attn import flash_attn_with_kvcache

            batch_idx = torch.tensor(slots, device="cuda", dtype=torch.int32)
            k4, v4, q4 = cache.k(17), cache.v(17), q[:, None]
            return time_ms(lambda: flash_attn_with_kvcache(q4, k4, v4, cache_seqlens=used, cache_batch_idx=batch_idx))
        k, v = cache.rows(17)
        return time_ms(lambda: fa2(q, k, v, cu_q, starts, 1, max_tokens, 0.0, True, False, seqused_k=used))


def torch_case(stacked: bool, lens: list[int], max_tokens: int) -> float:
    b = len(lens)
    shape = (b, max_tokens, LAYERS if stacked else 1, HKV, D)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    layer = 17 if stacked else 0
    kr, vr = k.flatten(0, 1)[:, layer], v.flatten(0, 1)[:, layer]
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    starts = torch.arange(b + 1, device="cuda", dtype=torch.int32) * max_tokens
    used = torch.tensor(lens, device="cuda", dtype=torch.int32)
    ms = time_ms(lambda: fa2(q, kr, vr, cu_q, starts, 1, max_tokens, 0.0, True, False, seqused_k=used))
    del k, v
    return ms


def paged_case(lens: list[int], max_tokens: int) -> float:
    spec = paged_spec(LAYERS, HKV, D, dtype=torch.bfloat16, max_slots=len(lens), max_tokens=max_tokens)
    cache = PagedKVCache(spec, sum(spec.physical_bytes_for(n) for n in lens), "cuda")
    slots = [cache.alloc_slot() for _ in lens]
    for s, n in zip(slots, lens):
        cache.ensure(s, n)
    k, v = cache.rows(17)
    k.normal_()
    v.normal_()
    rows = torch.cat([cache.token_rows(s, 0, n) for s, n in zip(slots, lens)]).cuda()
    cu_k = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
    ms = time_ms(lambda: fa2(q, k[rows], v[rows], cu_q, cu_k, 1, max(lens), 0.0, True, False))
    del cache
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lo", type=int, default=512)
    parser.add_argument("--hi", type=int, default=2304)
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    args = parser.parse_args()
    rng = random.Random(0)
    lens = [rng.randint(args.lo, args.hi) for _ in range(args.batch)]
    max_tokens = args.hi
    kv_bytes = 2 * sum(lens) * HKV * D * 2
    vmm = CudaVMM(0)
    cases = {
        "torch contiguous per layer": lambda: torch_case(False, lens, max_tokens),
        "torch stacked layers (strided)": lambda: torch_case(True, lens, max_tokens),
        "vattn per_layer 2MiB": lambda: virtual_case("per_layer", 2 * MiB, lens, max_tokens, vmm),
        "vattn mega 2MiB": lambda: virtual_case("mega", 2 * MiB, lens, max_tokens, vmm),
        "vattn mega 8MiB": lambda: virtual_case("mega", 8 * MiB, lens, max_tokens, vmm),
        "vattn mega 32MiB": lambda: virtual_case("mega", 32 * MiB, lens, max_tokens, vmm),
        "paged@16 gather + FA2": lambda: paged_case(lens, max_tokens),
    }
    if importlib.util.find_spec("flash_attn"):
        cases["flash_attn kvcache per_layer 2MiB"] = lambda: virtual_case("per_layer", 2 * MiB, lens, max_tokens, vmm, "flash_attn")
        cases["flash_attn kvcache mega 2MiB"] = lambda: virtual_case("mega", 2 * MiB, lens, max_tokens, vmm, "flash_attn")
    rows, data = [], {"lens": lens, "results": {}}
    for name, fn in cases.items():
        ms = fn()
        torch.cuda.empty_cache()
        data["results"][name] = ms
        rows.append([name, ms * 1e3, kv_bytes / (ms / 1e3) / 1e12])
    print(f"decode, B={args.batch}, ctx U[{args.lo}, {args.hi}] (mean {sum(lens) / len(lens):.0f}), one layer")
    report.write("attention_layout", ["case", "µs per layer", "KV read TB/s"], rows, data, args.out)
    vmm.close()


if __name__ == "__main__":
    main()
