#!/usr/bin/env python3
"""FlashInfer 0.7.2.post1 smoke test: paged decode + paged causal prefill, bf16,
head_dim 128, 32 q heads / 8 kv heads (GQA group 4), NHD layout.

usage: python smoke.py [decode|prefill|all]   (default: all)
env:   SMOKE_PAGE_SIZES="256 16"   page sizes to test (default "256 16")
       SMOKE_PREFILL_BACKEND=auto  auto (-> fa3 on H100) | fa2 | fa3
       SMOKE_STRIDED=1             also run on a strided per-layer view
                                   cache5d[:, :, layer] of [pages, page, L, H, D]
       SMOKE_TC=0                  1: also decode with use_tensor_cores=True
                                   (compiles the fa2 prefill module too)
Prints max abs error vs a float32 torch reference; exit code 1 if any check fails.
"""
import math
import os
import sys
import time

import torch

import flashinfer

DEV = "cuda"
DT = torch.bfloat16
HQ, HKV, D = 32, 8, 128
TOL = 3e-2  # bf16 output; typical max abs err ~4e-3..1.5e-2
NUM_LAYERS = 3  # for the strided-view test
failures = []


def log(*a):
    print(*a, flush=True)


def make_paged(kv_lens, page_size, strided, gen):
    """Random paged K/V caches (NHD) holding len(kv_lens) sequences in shuffled pages.

    Returns k_cache, v_cache ([num_pages, page_size, HKV, D], possibly strided views),
    indptr, indices, last_page_len (int32, cuda)."""
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages_per)
    num_pages = total + 3  # a few unused pages
    if strided:
        # one buffer holding all layers; per-layer view has page stride
        # page_size*NUM_LAYERS*HKV*D > page_size*HKV*D
        k5 = torch.randn(num_pages, page_size, NUM_LAYERS, HKV, D, generator=gen, device=DEV).to(DT)
        v5 = torch.randn(num_pages, page_size, NUM_LAYERS, HKV, D, generator=gen, device=DEV).to(DT)
        k_cache, v_cache = k5[:, :, 1], v5[:, :, 1]
    else:
        k_cache = torch.randn(num_pages, page_size, HKV, D, generator=gen, device=DEV).to(DT)
        v_cache = torch.randn(num_pages, page_size, HKV, D, generator=gen, device=DEV).to(DT)
    perm = torch.randperm(num_pages, generator=gen, device=DEV)[:total].to(torch.int32)
    indptr = torch.tensor([0] + list(torch.tensor(pages_per).cumsum(0).tolist()),
                          dtype=torch.int32, device=DEV)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages_per)],
                        dtype=torch.int32, device=DEV)
    return k_cache, v_cache, indptr, perm, last


def gather(cache, indptr, indices, i, n):
    pages = indices[indptr[i]:indptr[i + 1]].long()
    return cache[pages].reshape(-1, HKV, D)[:n]


def ref_attn(q, k, v, causal):
    """q [lq, HQ, D]; k, v [lk, HKV, D]; causal aligned bottom-right (FlashInfer convention)."""
    g = HQ // HKV
    k = k.float().repeat_interleave(g, dim=1)
    v = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(D)
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        qi = torch.arange(lq, device=q.device)[:, None]
        ki = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill((ki > qi + (lk - lq))[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def check(name, out, ref):
    err = (out.float() - ref).abs().max().item()
    ok = math.isfinite(err) and err < TOL
    log(f"  {name}: max_abs_err={err:.3e} {'OK' if ok else 'FAIL'}")
    if not ok:
        failures.append(name)


def test_decode(page_size, strided, use_tc=False):
    gen = torch.Generator(device=DEV).manual_seed(1234 + page_size)
    kv_lens = [7, 255, 256, 1000]  # batch 4
    k, v, indptr, indices, last = make_paged(kv_lens, page_size, strided, gen)
    q = torch.randn(len(kv_lens), HQ, D, generator=gen, device=DEV).to(DT)
    ws = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=DEV)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=use_tc)
    t = time.time()
    w.plan(indptr, indices, last, HQ, HKV, D, page_size,
           q_data_type=DT, kv_data_type=DT)  # optional args are keyword-only in 0.7.2
    t_plan = time.time() - t
    t = time.time()
    out = w.run(q, (k, v))
    torch.cuda.synchronize()
    t_run = time.time() - t
    ref = torch.cat([ref_attn(q[i:i + 1], gather(k, indptr, indices, i, n),
                              gather(v, indptr, indices, i, n), causal=False)
                     for i, n in enumerate(kv_lens)])
    tag = f"decode ps={page_size} strided={strided} tc={use_tc} backend={w.resolved_backend}"
    log(f"  {tag}: plan {t_plan:.1f}s (incl. JIT), first run {t_run:.2f}s, k.stride={tuple(k.stride())}")
    check(tag, out, ref)


def test_prefill(page_size, strided, backend):
    gen = torch.Generator(device=DEV).manual_seed(4321 + page_size)
    q_lens = [5, 17, 1, 300]
    kv_lens = [20, 17, 40, 600]
    k, v, indptr, indices, last = make_paged(kv_lens, page_size, strided, gen)
    qo_indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(),
                             dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen, device=DEV).to(DT)
    ws = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=DEV)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    t = time.time()
    w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, page_size,
           causal=True, q_data_type=DT, kv_data_type=DT)
    t_plan = time.time() - t
    t = time.time()
    out = w.run(q, (k, v))
    torch.cuda.synchronize()
    t_run = time.time() - t
    refs = []
    for i, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        qs = q[qo_indptr[i]:qo_indptr[i + 1]]
        refs.append(ref_attn(qs, gather(k, indptr, indices, i, lk),
                             gather(v, indptr, indices, i, lk), causal=True))
    ref = torch.cat(refs)
    tag = f"prefill ps={page_size} strided={strided} backend={backend}->{w._backend}"
    log(f"  {tag}: plan {t_plan:.1f}s (incl. JIT), first run {t_run:.2f}s, k.stride={tuple(k.stride())}")
    check(tag, out, ref)


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    page_sizes = [int(x) for x in os.environ.get("SMOKE_PAGE_SIZES", "256 16").split()]
    strided_opts = [False, True] if os.environ.get("SMOKE_STRIDED", "1") == "1" else [False]
    backend = os.environ.get("SMOKE_PREFILL_BACKEND", "auto")
    log(f"flashinfer {flashinfer.__version__} torch {torch.__version__} "
        f"cuda {torch.version.cuda} device {torch.cuda.get_device_name()} "
        f"cc {torch.cuda.get_device_capability()}")
    from flashinfer.jit import env as jit_env
    log(f"JIT dir: {jit_env.FLASHINFER_JIT_DIR}")
    if what in ("decode", "all"):
        log("[decode] BatchDecodeWithPagedKVCacheWrapper, batch 4, kv_lens [7,255,256,1000]")
        for ps in page_sizes:
            for st in strided_opts:
                test_decode(ps, st)
        if os.environ.get("SMOKE_TC", "0") == "1":
            for ps in page_sizes:
                test_decode(ps, False, use_tc=True)
    if what in ("prefill", "all"):
        log("[prefill] BatchPrefillWithPagedKVCacheWrapper causal, q [5,17,1,300] kv [20,17,40,600]")
        for ps in page_sizes:
            for st in strided_opts:
                test_prefill(ps, st, backend)
    if failures:
        log(f"FAILED: {failures}")
        sys.exit(1)
    log("ALL OK")


if __name__ == "__main__":
    main()
