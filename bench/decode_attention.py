"""Decode attention kernels over the virtual cache, one layer: flash-attn's split-KV kernel (FA2, the engine's
decode until now) against FlashAttention-3's KV-cache kernel (the ``fa3`` backend, where tools/build_fa3.py built
it), FlashInfer's (its FA3 prefill kernel run as decode, and TensorRT-LLM's XQA over the slots as strided pages)
and the Triton split-KV kernel (``worker/attention/triton_decode.py``) in a few tunings.

Batches as the engine's decode steps meet them: W1's (128 sequences, 512-2176 tokens), the decode-heavy
workload's (256, 256-1280), long contexts (16 of 8K-32K, Qwen2.5-7B's 28/4 heads). The cache is the ``mega``
layout's strided layer view (4 layers held), random bf16. Each row: median GPU time of the call (CUDA events),
the K/V bytes it must read over that time, and the error against a float32 reference.

    python bench/decode_attention.py [--name decode_attention_h100]
"""

from __future__ import annotations

import argparse
import itertools
import math
import random

import torch

import report
from timing import time_ms
from worker.attention.triton_decode import decode_attention, split_tokens

LAYERS, LAYER = 4, 1
CASES = {  # name: (batch, min len, max len, query heads, KV heads)
    "W1 B=128": (128, 512, 2176, 32, 8),
    "decode-heavy B=256": (256, 256, 1280, 32, 8),
    "B=64 4K": (64, 4096, 4096, 32, 8),
    "long B=16 8K-32K qwen": (16, 8192, 32000, 28, 4),
}


def reference(q, k, v, lens, slots) -> torch.Tensor:
    outs = []
    for i in range(q.shape[0]):
        group = q.shape[1] // k.shape[2]
        kk = k[slots[i], : lens[i]].float().transpose(0, 1).repeat_interleave(group, 0)
        vv = v[slots[i], : lens[i]].float().transpose(0, 1).repeat_interleave(group, 0)
        s = (q[i].float()[:, None] @ kk.transpose(1, 2))[:, 0] / math.sqrt(q.shape[-1])
        outs.append((s.softmax(-1)[:, None] @ vv)[:, 0])
    return torch.stack(outs)


def flashinfer_fa3(q, k, v, lens: list[int], slots: list[int], slot_tokens: int):
    """FlashInfer's batch prefill kernel (FA3 on Hopper) run as decode, one query a sequence, over the virtual
    cache's slots as pages (as the engine's ``flashinfer`` backend hands them over); planned once, outside the
    timing. None without FlashInfer."""
    try:
        import flashinfer
    except ImportError:
        return None
    from worker.attention.flashinfer import PAGE_TOKENS
    from worker.attention.metadata import page_rows

    page = page_rows(slot_tokens, PAGE_TOKENS)
    per_slot = slot_tokens // page
    tables = [[s * per_slot + p for p in range(-(-n // page))] for s, n in zip(slots, lens)]
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    ints = lambda xs: torch.tensor(list(xs), dtype=torch.int32)  # noqa: E731
    wrapper.plan(ints(range(len(lens) + 1)), ints(itertools.accumulate((len(t) for t in tables), initial=0)),
                 ints(p for t in tables for p in t).cuda(), ints(n - (len(t) - 1) * page for n, t in zip(lens, tables)),
                 q.shape[1], k.shape[2], q.shape[2], page, causal=False, q_data_type=q.dtype, kv_data_type=k.dtype)
    pages = (k.flatten(0, 1).unflatten(0, (-1, page)), v.flatten(0, 1).unflatten(0, (-1, page)))
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, pages, out=out)


def flashinfer_xqa(q, k, v, lens, slots, slot_tokens: int, page: int = 64):
    """TensorRT-LLM's XQA decode kernel (FlashInfer's port: GQA heads sharing one K/V read, split over the KV on
    its own) over the virtual cache's slots as strided pages of ``page`` tokens -- the page table is arithmetic,
    slot * pages a slot + page. None without FlashInfer or when the slot is not a whole number of pages."""
    try:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache
    except ImportError:
        return None
    if slot_tokens % page:
        return None
    per_slot = slot_tokens // page
    tables = (slots.long()[:, None] * per_slot + torch.arange(per_slot, device="cuda")).to(torch.int32)
    pages = (k.flatten(0, 1).unflatten(0, (-1, page)), v.flatten(0, 1).unflatten(0, (-1, page)))
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    seq_lens = lens.to(torch.uint32)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(q.shape[-1])
    return lambda: xqa_batch_decode_with_kv_cache(q, pages, workspace, tables, seq_lens, slot_tokens,
                                                  bmm1_scale=scale, out=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="decode_attention")
    parser.add_argument("--no-triton", action="store_true", help="leave out the Triton kernel's tunings")
    args = parser.parse_args()
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    try:
        from flash_attn_interface import flash_attn_with_kvcache as fa3_kvcache
    except ImportError:
        fa3_kvcache = None
    rows, data = [], {}
    for case, (batch, lo, hi, hq, hkv) in CASES.items():
        rng = random.Random(0)
        lens_host = [rng.randint(lo, hi) for _ in range(batch)]
        slot_tokens = hi
        shape = (batch, slot_tokens, LAYERS, hkv, 128)
        k_all = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        v_all = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        k, v = k_all[:, :, LAYER], v_all[:, :, LAYER]
        q = torch.randn(batch, hq, 128, dtype=torch.bfloat16, device="cuda")
        lens = torch.tensor(lens_host, dtype=torch.int32, device="cuda")
        slots = torch.randperm(batch, device="cuda").to(torch.int32)
        ref = reference(q[:8], k, v, lens[:8], slots[:8])
        kv_bytes = sum(lens_host) * hkv * 128 * 2 * 2
        runs = {}
        if flash_attn_with_kvcache is not None:
            runs["flash_attn FA2 split-KV"] = lambda: flash_attn_with_kvcache(
                q[:, None], k, v, cache_seqlens=lens, cache_batch_idx=slots)[:, 0]
            for splits in (1, 2, 4, 8):  # its own choice above; these force the KV split
                runs[f"flash_attn FA2 num_splits={splits}"] = lambda n=splits: flash_attn_with_kvcache(
                    q[:, None], k, v, cache_seqlens=lens, cache_batch_idx=slots, num_splits=n)[:, 0]
        if fa3_kvcache is not None:
            runs["FA3 by slot (TMA tiles)"] = lambda: fa3_kvcache(
                q[:, None], k, v, cache_seqlens=lens, cache_batch_idx=slots)[:, 0]
            for page in (16, 32, 64):  # the fa3 backend's path: the slots as pages, an arithmetic page table
                table = slots[:, None] * (slot_tokens // page) + torch.arange(
                    slot_tokens // page, device="cuda", dtype=torch.int32)
                runs[f"FA3 pages of {page}"] = lambda p=page, t=table: fa3_kvcache(
                    q[:, None], k.reshape(-1, p, hkv, 128), v.reshape(-1, p, hkv, 128), cache_seqlens=lens,
                    page_table=t)[:, 0]
        fa3 = flashinfer_fa3(q, k, v, lens_host, slots.tolist(), slot_tokens)
        if fa3 is not None:
            runs["flashinfer FA3 (prefill kernel, q=1)"] = fa3
        for page in (64, 128):
            xqa = flashinfer_xqa(q, k, v, lens, slots, slot_tokens, page)
            if xqa is not None:
                runs[f"flashinfer XQA pages of {page}"] = xqa
        default_split = split_tokens(slot_tokens)
        tunings = [(n, s, 4, default_split) for n, s in itertools.product((32, 64, 128), (2, 3, 4))]
        tunings += [(128, s, 8, default_split) for s in (2, 3)] + [(64, 3, 4, 512), (64, 3, 4, 1024)]
        if args.no_triton:
            tunings = []
        for block_n, stages, warps, split in tunings:
            runs[f"triton n{block_n} s{stages} w{warps} split{split}"] = (
                lambda b=block_n, s=stages, w=warps, sp=split: decode_attention(
                    q, k, v, lens, slots, block_n=b, num_stages=s, num_warps=w, split=sp))
        data[case] = {"batch": batch, "lens": lens_host, "kv_bytes": kv_bytes, "runs": {}}
        for name, fn in runs.items():
            try:
                err = ((fn()[:8].float() - ref).norm() / ref.norm()).item()
                ms = time_ms(fn, iters=50)
            except Exception as exc:  # a tuning Triton cannot build (shared memory) is reported, not fatal
                print(f"{case} {name}: {exc!r}"[:300])
                continue
            data[case]["runs"][name] = {"ms": ms, "rel_err": err, "tb_per_s": kv_bytes / ms / 1e9}
        measured = data[case]["runs"]
        base = measured.get("flash_attn FA2 split-KV", {}).get("ms")
        triton_best = sorted((n for n in measured if n.startswith("triton")), key=lambda n: measured[n]["ms"])[:4]
        for name in [n for n in measured if not n.startswith("triton")] + triton_best:
            r = measured[name]
            rows.append([case, name, r["ms"] * 1e3, r["tb_per_s"], r["rel_err"], base / r["ms"] if base else None])
        del k_all, v_all
        torch.cuda.empty_cache()
    report.write(args.name, ["case", "kernel", "µs", "TB/s of K/V", "rel. error", "flash_attn / this"], rows, data)


if __name__ == "__main__":
    main()
