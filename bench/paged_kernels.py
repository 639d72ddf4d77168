"""Attention kernels over the virtual cache against the strongest paged kernels: the vAttention paper's kernel
figures (FA2_vAttention against FA2_Paged and FI_Paged), on the engine's own caches and backends.

Decode: B sequences of ``ctx`` tokens each, one query each. Prefill: one prompt of L tokens, chunked (chunks of
``--chunk`` queries, each attending to everything before it: the sum over the chunks) and unchunked (one causal
call over all L). Llama-3-8B attention (32 query heads, 8 KV heads, head dim 128), bf16; the caches hold 4 layers
so that each layer's rows are strided as in the engine (layer 1 is timed). Paged blocks are handed out round-robin
between the sequences, as decode growth does, so that a sequence's blocks are not adjacent.

Runs (each where its package imports):
  * ``flash_attn virtual``: the engine's ``flash_attn`` backend over the virtual ``mega`` cache (decode:
    ``flash_attn_with_kvcache`` with ``cache_batch_idx``; prefill: the plain varlen FA2 kernel in place);
  * ``flash_attn paged``: the engine's ``flash_attn_paged`` backend over 256-token blocks (decode:
    ``flash_attn_with_kvcache`` with ``block_table``; prefill: ``flash_attn_varlen_func`` with ``block_table``);
  * ``fa2 virtual``: torch's FA2 over the virtual cache (the engine's ``fa2`` backend);
  * ``flashinfer paged@16`` / ``@256``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` /
    ``BatchPrefillWithPagedKVCacheWrapper`` over the same paged cache's blocks;
  * ``flashinfer virtual``: the same wrappers over the virtual cache, each slot's rows as consecutive 256-token
    pages (the engine's ``flashinfer`` backend): FlashInfer's kernels unmodified, reading each sequence
    contiguously. (``paged_kernels_flashinfer_virtual_h100.json`` was measured with one page per slot.)
Times are medians of CUDA-event timings (GPU time of the calls; host work is outside).

    python bench/paged_kernels.py [--batches 1 16 64 128 256] [--contexts 1024 4096 16384 32768 65536]
    python bench/paged_kernels.py --name paged_kernels_h100 --replot    # the figure again, from the JSON
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import report  # noqa: E402
from timing import time_ms  # noqa: E402
from kvmem import KVCacheSpec, PagedKVCache, VirtualKVCache, paged_spec  # noqa: E402
from worker.attention import AttentionMetadata, SeqAttention, get_backend  # noqa: E402
from worker.attention.flashinfer import PAGE_TOKENS  # noqa: E402
from worker.attention.metadata import page_rows  # noqa: E402
from worker.config import PRESETS  # noqa: E402

_LLAMA3 = PRESETS["llama-3-8b"]
HQ, HKV, D = _LLAMA3.num_heads, _LLAMA3.num_kv_heads, _LLAMA3.head_dim
LAYERS, LAYER = 4, 1
MAX_TOKENS = 2 << 20  # decode points past this many cached tokens in all are skipped (32 GiB of 4 layers)


@dataclass
class Cache:
    """One run's cache with ``lens`` tokens backed in its slots, random K/V in the timed layer."""

    cache: VirtualKVCache | PagedKVCache
    slots: list[int]

    @classmethod
    def make(cls, paged_block: int | None, lens: list[int], vmm) -> "Cache":
        longest = max(lens)
        if paged_block:
            spec = paged_spec(LAYERS, HKV, D, paged_block, dtype=torch.bfloat16, max_slots=len(lens), max_tokens=longest)
            cache = PagedKVCache(spec, sum(spec.physical_bytes_for(n) for n in lens), "cuda")
        else:
            spec = KVCacheSpec(LAYERS, HKV, D, torch.bfloat16, len(lens), longest, "mega", 2 << 20)
            cache = VirtualKVCache(spec, sum(spec.physical_bytes_for(n) for n in lens), vmm)
        slots = [cache.alloc_slot() for _ in lens]
        step = paged_block or longest
        for upto in range(step, longest + step, step):  # round-robin: blocks interleave between sequences
            for s, n in zip(slots, lens):
                cache.ensure(s, min(upto, n))
        k, v = cache.rows(LAYER)
        if paged_block:
            k.normal_()
            v.normal_()
        else:
            for s, n in zip(slots, lens):
                cache.k(LAYER)[s, :n].normal_()
                cache.v(LAYER)[s, :n].normal_()
        return cls(cache, slots)

    def close(self) -> None:
        self.cache.close()
        torch.cuda.empty_cache()


def backend_ms(backend: str, cache: Cache, seqs: list[SeqAttention], iters: int) -> float:
    impl = get_backend(backend, "cuda")
    meta = AttentionMetadata.build(seqs, cache.cache, torch.device("cuda"), impl.reads)
    q = torch.randn(sum(s.query_len for s in seqs), HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = cache.cache.rows(LAYER)
    return time_ms(lambda: impl.forward(q, k, v, meta), iters, min(3, iters))


def flashinfer_ms(cache: Cache, seqs: list[SeqAttention], iters: int) -> float:
    """FlashInfer's paged wrappers over ``cache``'s blocks (decode when every query is one token). Over the virtual
    cache, a slot is consecutive pages of its rows: the same kernels read it contiguously, unmodified."""
    import flashinfer

    pc = cache.cache
    if isinstance(pc, PagedKVCache):
        bs, kv = pc.block_size, (pc.k(LAYER), pc.v(LAYER))  # [blocks, block_size, H, D], strided over the layers (NHD)
        tables = [pc.block_table(s.slot) for s in seqs]
    else:  # a slot's rows as consecutive pages, as the engine's flashinfer backend hands them over
        bs = page_rows(pc.spec.slot_tokens, PAGE_TOKENS)
        kv = tuple(rows.unflatten(0, (-1, bs)) for rows in pc.rows(LAYER))  # [slots * slot_tokens / bs, bs, H, D]
        per_slot = pc.spec.slot_tokens // bs
        tables = [[s.slot * per_slot + p for p in range(-(-s.kv_len // bs))] for s in seqs]
    as_int = dict(dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0] + [len(t) for t in tables], **as_int).cumsum(0, dtype=torch.int32)
    kv_indices = torch.tensor([b for t in tables for b in t], **as_int)
    last = torch.tensor([s.kv_len - (len(t) - 1) * bs for s, t in zip(seqs, tables)], **as_int)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    q = torch.randn(sum(s.query_len for s in seqs), HQ, D, device="cuda", dtype=torch.bfloat16)
    if all(s.query_len == 1 for s in seqs):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(kv_indptr, kv_indices, last, HQ, HKV, D, bs, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        qo_indptr = torch.tensor([0] + [s.query_len for s in seqs], **as_int).cumsum(0, dtype=torch.int32)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, HQ, HKV, D, bs, causal=True,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return time_ms(lambda: wrapper.run(q, kv), iters, min(3, iters))


def importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception as exc:  # a package that is there but does not load is left out, saying why
        print(f"{name} does not import ({exc!r}): its runs are left out")
        return False


def runs() -> dict[str, tuple[int | None, str]]:
    """Run name -> (paged block size or None for the virtual cache, backend or "flashinfer")."""
    out = {}
    if importlib.util.find_spec("flash_attn"):
        out["flash_attn virtual"] = (None, "flash_attn")
        out["flash_attn paged@256"] = (256, "flash_attn_paged")
    out["fa2 virtual"] = (None, "fa2")
    if importable("flashinfer"):
        out["flashinfer virtual"] = (None, "flashinfer")
        out["flashinfer paged@16"] = (16, "flashinfer")
        out["flashinfer paged@256"] = (256, "flashinfer")
    return out


def measure(run: tuple[int | None, str], lens: list[int], seq_parts, iters: int, vmm) -> float:
    """``seq_parts(slots)`` -> list of SeqAttention lists, one per timed call (summed)."""
    block, backend = run
    cache = Cache.make(block, lens, vmm)
    try:
        calls = seq_parts(cache.slots)
        if backend == "flashinfer":
            return sum(flashinfer_ms(cache, seqs, iters) for seqs in calls)
        return sum(backend_ms(backend, cache, seqs, iters) for seqs in calls)
    finally:
        cache.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768, 65536])
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--unchunked-max", type=int, default=65536, help="longest unchunked prefill measured")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--name", default="paged_kernels")
    parser.add_argument("--replot", action="store_true", help="only draw results/NAME.png again from results/NAME.json")
    args = parser.parse_args()
    if args.replot:
        data = json.loads((Path(report.RESULTS) / f"{args.name}.json").read_text())
        plot(data, data["runs"][0], Path(report.RESULTS) / f"{args.name}.png")
        return
    from kvmem.vmm.cuda import CudaVMM  # needs cuda-bindings: a replot does not

    vmm = CudaVMM(0)
    chosen = runs()
    base = next(iter(chosen))
    data: dict = {"decode": {}, "prefill_chunked": {}, "prefill_unchunked": {}, "runs": list(chosen)}
    rows = []
    for b in args.batches:
        for ctx in args.contexts:
            if b * ctx > MAX_TOKENS:
                continue
            point = {name: measure(run, [ctx] * b, lambda slots: [[SeqAttention(s, 1, ctx) for s in slots]], args.iters, vmm)
                     for name, run in chosen.items()}
            data["decode"][f"{b}x{ctx}"] = point
            rows += [["decode", f"B={b} ctx={ctx}", name, ms * 1e3, point[base] / ms] for name, ms in point.items()]
            print(rows[-len(point):], flush=True)
    for n in args.prefill_lengths:
        def chunks(slots, n=n):
            return [[SeqAttention(slots[0], min(args.chunk, n - start), min(start + args.chunk, n))]
                    for start in range(0, n, args.chunk)]

        modes = [("prefill_chunked", chunks)]
        if n <= args.unchunked_max:
            modes.append(("prefill_unchunked", lambda slots, n=n: [[SeqAttention(slots[0], n, n)]]))
        for mode, parts in modes:
            iters = max(3, args.iters * 8192 // n)
            point = {name: measure(run, [n], parts, iters, vmm) for name, run in chosen.items()}
            data[mode][str(n)] = point
            rows += [[mode, f"L={n}", name, ms * 1e3, point[base] / ms] for name, ms in point.items()]
            print(rows[-len(point):], flush=True)
    vmm.close()
    report.write(args.name, ["kernel", "point", "run", "µs per layer", f"{base} / this"], rows,
                 {"layers_in_cache": LAYERS, "chunk": args.chunk, **data})
    plot(data, base, Path(report.RESULTS) / f"{args.name}.png")


def plot(data: dict, base: str, path: Path) -> None:
    """The paper's style: each run's speed relative to the virtual flash-attn run, per point."""
    panels = [(k, v) for k, v in data.items() if k in ("decode", "prefill_chunked", "prefill_unchunked") and v]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.3), squeeze=False)
    for ax, (kind, points) in zip(axes[0], panels):
        labels = list(points)
        names = list(next(iter(points.values())))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar([x + i * width for x in range(len(labels))], [points[p][base] / points[p][name] for p in labels],
                   width, label=name)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=45, ha="right", fontsize=7)
        ax.set(title=f"{kind} (Llama-3-8B heads, one layer)", ylabel=f"speed relative to {base}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
