"""How the bytes of a layer's K/V lie in memory, and what that costs decode attention: the same decode batch
read by flash-attn's split-KV kernel (FA2) and FlashAttention-3 from K/V arranged five ways.

  * ``per_layer``   -- ``[slot, token, H, D]`` per layer (the ``per_layer`` layout; vLLM's blocks, unpermuted):
                       a layer's rows are contiguous.
  * ``mega``        -- ``[slot, token, layer, H, D]`` (the ``mega`` layout): one token's rows of all layers
                       side by side, so a layer's rows are 2 KiB runs ``layers * 2 KiB`` apart.
  * ``mega_kv``     -- ``[slot, token, layer, K|V, H, D]``: K and V of one token and layer side by side.
  * ``mega_pN``     -- ``[slot, token // N, layer, N, H, D]``: within a page of N tokens, each layer's N rows
                       contiguous -- read through a page table of N-token pages, with the page stride
                       ``layers`` times a layer's run.
  * ``vllm``        -- vLLM's cache: ``[block, 16, H, D]`` per layer, blocks handed out in random order.

Plain torch allocations: the virtual cache's 2 MiB pages are contiguous physical memory, so a torch tensor
with the same strides reads the same (``attention_layout.py`` checks that against ``VirtualKVCache``). Each row:
the GPU time of one layer's call, from CUDA events around 50 calls queued back to back (as the engine's CUDA
graphs run them: a kernel's host-side overhead does not count), and the K/V bytes it must read over that time.
FA3 built with decode tiles (``tools/build_fa3.py``) is timed with them on and off (``VATTN_FA3_DECODE_TILES``).

    python bench/kv_arrangement.py [--name kv_arrangement_h100] [--cases w1 decode]
"""

from __future__ import annotations

import argparse
import os
import random

import torch

import report
from timing import queued_ms

LAYERS, LAYER, HQ, HKV, D = 32, 17, 32, 8, 128
CASES = {  # name: (batch, min len, max len), the engine's decode batches (decode_attention.py's)
    "w1": (128, 512, 2176),
    "decode": (256, 256, 1280),
    "4k": (64, 4096, 4096),
}
DT = torch.bfloat16


def tiles(fn, on: bool):
    """``fn`` with FA3's decode tiles on or off (the build reads the switch on every call)."""
    def run():
        os.environ["VATTN_FA3_DECODE_TILES"] = "1" if on else "0"
        return fn()
    return run


def arrange(name: str, batch: int, tokens: int):
    """K and V of layer LAYER arranged as ``name``: ``(k, v, page)`` where ``page`` is None for a by-slot view
    ``[slot, token, H, D]`` and N for a pages view ``[slot * tokens // N, N, H, D]`` whose slot s is pages
    ``s * tokens // N ...``; for ``vllm``, ``(k, v, table)`` with the block table."""
    if name == "per_layer":
        k, v = (torch.randn(batch, tokens, HKV, D, dtype=DT, device="cuda") for _ in range(2))
        return k, v, None
    if name == "mega":
        k, v = (torch.randn(batch, tokens, LAYERS, HKV, D, dtype=DT, device="cuda")[:, :, LAYER] for _ in range(2))
        return k, v, None
    if name == "mega_kv":
        kv = torch.randn(batch, tokens, LAYERS, 2, HKV, D, dtype=DT, device="cuda")[:, :, LAYER]
        return kv[:, :, 0], kv[:, :, 1], None
    if name.startswith("mega_p"):
        n = int(name[6:])
        k, v = (torch.randn(batch, tokens // n, LAYERS, n, HKV, D, dtype=DT, device="cuda")[:, :, LAYER].flatten(0, 1)
                for _ in range(2))
        return k, v, n
    if name == "vllm":
        blocks = batch * tokens // 16
        k, v = (torch.randn(blocks, 16, HKV, D, dtype=DT, device="cuda") for _ in range(2))
        table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, tokens // 16)
        return k, v, table
    raise ValueError(f"unknown arrangement {name!r}")


def reference(name: str, k, v, page, slots, q, lens, rows: int = 4) -> torch.Tensor:
    """Float32 attention of the first ``rows`` sequences (sequence i reads slot ``slots[i]``, or row i of
    ``vllm``'s block table)."""
    out = []
    for i in range(rows):
        n = int(lens[i])
        if name == "vllm":
            ki, vi = (x[page[i]].flatten(0, 1) for x in (k, v))
        elif page is None:
            ki, vi = k[slots[i]], v[slots[i]]
        else:
            ki, vi = (x.unflatten(0, (len(slots), -1))[slots[i]].flatten(0, 1) for x in (k, v))
        ki, vi = (x[:n].float().repeat_interleave(HQ // HKV, dim=1) for x in (ki, vi))
        scores = torch.einsum("hd,thd->ht", q[i].float(), ki) / D**0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), vi))
    return torch.stack(out)


def fa3_calls(fa3_kvcache, q, k, v, lens, table, with_tiles: bool) -> dict:
    """FA3's decode over pages ``k``/``v`` through ``table``: batched queries (FA3's split heuristic), varlen
    queries, varlen with num_splits capped at 32 as vLLM calls it under CUDA graphs, and varlen given a schedule
    worked out once (as the ``fa3`` backend's decode steps call it: one schedule for every layer); with decode tiles
    on and off where the build has them."""
    from flash_attn_interface import get_scheduler_metadata

    cu_q = torch.arange(q.shape[0] + 1, device="cuda", dtype=torch.int32)

    schedules = {}  # per decode-tile setting: the schedule depends on the tile size

    def schedule():
        on = os.environ.get("VATTN_FA3_DECODE_TILES", "1")
        if on not in schedules:
            schedules[on] = get_scheduler_metadata(q.shape[0], 1, table.shape[1] * k.shape[1], HQ, HKV, D, lens,
                                                   qkv_dtype=DT, cu_seqlens_q=cu_q, page_size=k.shape[1], causal=True)
        return schedules[on]
    calls = {
        "": lambda: fa3_kvcache(q[:, None], k, v, cache_seqlens=lens, page_table=table)[:, 0],
        ", varlen": lambda: fa3_kvcache(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu_q,
                                        max_seqlen_q=1, causal=True),
        ", vLLM call": lambda: fa3_kvcache(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu_q,
                                           max_seqlen_q=1, causal=True, num_splits=32),
        # the engine's: the schedule worked out once a step, every layer's call reusing it (timed here: the call alone)
        ", varlen, schedule once": lambda: fa3_kvcache(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu_q,
                                                       max_seqlen_q=1, causal=True, scheduler_metadata=schedule()),
    }
    if not with_tiles:
        return calls
    return {f"{how}, {'decode tiles' if on else '128-row tiles'}": tiles(fn, on)
            for how, fn in calls.items() for on in (False, True)}


def kernels(name: str, k, v, page, q, lens, slots, tokens: int, fa2_kvcache, fa3_kvcache, with_tiles: bool) -> dict:
    """The calls that can read arrangement ``name``: label -> zero-argument callable returning ``[B, HQ, D]``."""
    runs = {}
    if name == "vllm":
        if fa3_kvcache is not None:
            runs |= {f"FA3{how}": fn for how, fn in fa3_calls(fa3_kvcache, q, k, v, lens, page, with_tiles).items()}
        return runs
    if page is None:
        if fa2_kvcache is not None:
            runs["FA2 by slot"] = lambda: fa2_kvcache(q[:, None], k, v, cache_seqlens=lens, cache_batch_idx=slots)[:, 0]
        views = [(p, k.unflatten(1, (-1, p)).flatten(0, 1), v.unflatten(1, (-1, p)).flatten(0, 1)) for p in (64,)]
        # views, not copies: a copy would time a contiguous arrangement under this one's name
        assert all(x.data_ptr() == y.data_ptr() for p, kp, vp in views for x, y in ((kp, k), (vp, v))), name
    else:
        views = [(page, k, v)]
        if fa2_kvcache is not None and page % 256 == 0:
            table = slots[:, None] * (tokens // page) + torch.arange(tokens // page, device="cuda", dtype=torch.int32)
            runs["FA2 pages"] = lambda t=table: fa2_kvcache(q[:, None], k, v, cache_seqlens=lens, block_table=t)[:, 0]
    if fa3_kvcache is not None:
        for p, kp, vp in views:
            table = slots[:, None] * (tokens // p) + torch.arange(tokens // p, device="cuda", dtype=torch.int32)
            runs |= {f"FA3 pages of {p}{how}": fn
                     for how, fn in fa3_calls(fa3_kvcache, q, kp, vp, lens, table, with_tiles).items()}
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="kv_arrangement")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--arrangements", nargs="+", default=["per_layer", "mega", "vllm"],
                        help="also: mega_kv, mega_pN (N tokens a page)")
    args = parser.parse_args()
    try:
        from flash_attn import flash_attn_with_kvcache as fa2_kvcache
    except ImportError:
        fa2_kvcache = None
    try:
        from flash_attn_interface import flash_attn_with_kvcache as fa3_kvcache
    except ImportError:
        fa3_kvcache = None
    if fa2_kvcache is None and fa3_kvcache is None:
        raise SystemExit("neither flash_attn nor flash_attn_interface imports: nothing to time")
    with_tiles = False
    if fa3_kvcache is not None:
        import flash_attn_3

        with_tiles = getattr(flash_attn_3, "vattn_decode_tiles", False)
    rows, data = [], {}
    for case in args.cases:
        batch, lo, hi = CASES[case]
        tokens = -(-hi // 256) * 256
        rng = random.Random(0)
        lens_host = [rng.randint(lo, hi) for _ in range(batch)]
        lens = torch.tensor(lens_host, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, HQ, D, dtype=DT, device="cuda")
        kv_bytes = 2 * sum(lens_host) * HKV * D * DT.itemsize
        data[case] = {"batch": batch, "lens": lens_host, "kv_bytes": kv_bytes, "runs": {}}
        slots = torch.randperm(batch, device="cuda", dtype=torch.int32)
        for name in args.arrangements:
            k, v, page = arrange(name, batch, tokens)
            ref = reference(name, k, v, page, slots, q, lens_host)
            for label, fn in kernels(name, k, v, page, q, lens, slots, tokens, fa2_kvcache, fa3_kvcache,
                                        with_tiles).items():
                err = ((fn()[: len(ref)].float() - ref).norm() / ref.norm()).item()
                ms = queued_ms(fn)
                data[case]["runs"][f"{name} / {label}"] = {"ms": ms, "tb_per_s": kv_bytes / ms / 1e9, "rel_err": err}
                rows.append([case, name, label, ms * 1e3, kv_bytes / ms / 1e9, err])
                print(f"{case:7s} {name:10s} {label:48s} {ms * 1e3:8.1f} us {kv_bytes / ms / 1e9:5.2f} TB/s "
                      f"err {err:.1e}", flush=True)
            del k, v
            torch.cuda.empty_cache()
    report.write(args.name, ["case", "arrangement", "kernel", "µs", "TB/s of K/V", "rel. error"], rows, data)


if __name__ == "__main__":
    main()
