"""cuBLAS's pick against every candidate cuBLASLt lists, for ``llama-3-8b``'s projections at the row counts of
decode batches and prefill chunks.

Each call is timed queued back to back (as graph replays run them), cycling through enough copies of the weight
that none is read from L2 (a decode step's layers never reuse a weight), so a skinny matmul is timed at the
bandwidth it really gets. Per shape: ``F.linear`` (cuBLAS's heuristic), ``F.linear`` with torch's cuBLASLt path,
and each algorithm cuBLASLt's heuristic offers (``worker/csrc/lt_matmul.cpp``), with its largest difference from
``F.linear``'s result. The last table sums a decode step's matmuls (32 layers and the LM head).

Tried in the engine (2026-11-27): each worker timed these candidates over its own weights at start-up and ran the
winners at the CUDA graphs' batch sizes and a full prefill chunk. ABBA on the H200 against ``F.linear``
(``peer_tuned_matmuls_ab_h200.json``): W1 5.223 / 5.227 / 5.181 / 5.180 s against 5.247 / 5.242 / 5.253 / 5.240 s
(0.992x), decode-heavy 17.39 / 17.43 / 17.42 / 17.48 s against 17.36 / 17.37 / 17.40 / 17.35 s (1.003x): under 1%,
for a C++ extension compiled at start-up. Removed; this benchmark stays to measure it again.

    python bench/gemm_algos.py [--name gemm_algos_h100] [--rows 64,128,256,512,8192]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import report

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
LAYERS = 32
WORKSPACE = 32 << 20
SOURCE = Path(__file__).resolve().parent / "csrc" / "lt_matmul.cpp"


def load_extension():
    """``csrc/lt_matmul.cpp``, built by torch (cached by its source's hash), linked to the cuBLASLt torch loads."""
    from torch.utils.cpp_extension import load

    roots = [Path(torch.__file__).parent.parent / "nvidia", Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))]
    library = next((found[0] for root in roots if (found := sorted(glob.glob(str(root / "**" / "libcublasLt.so*"),
                                                                           recursive=True)))), None)
    if library is None:
        raise SystemExit(f"libcublasLt.so not found under {[str(r) for r in roots]}")
    return load(name="vattn_lt_matmul", sources=[str(SOURCE)], extra_cflags=["-O3", "-std=c++17"],
                extra_ldflags=[library], with_cuda=True)


def timed_us(fn, copies: int, min_calls: int = 200) -> float:
    """Median over 3 rounds of GPU microseconds a call takes, queued back to back, cycling ``copies`` inputs."""
    calls = max(min_calls // copies, 2) * copies
    for i in range(copies):
        fn(i)
    rounds = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i % copies)
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="gemm_algos")
    parser.add_argument("--rows", default="64,128,256,512,8192")
    parser.add_argument("--candidates", type=int, default=32, help="how many algorithms to ask cuBLASLt for")
    args = parser.parse_args()
    ext = load_extension()
    torch.manual_seed(0)
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    rows, raw = [], []
    step = {}  # m -> [default us, best us] summed over a decode step
    for proj, (n, k) in SHAPES.items():
        copies = max(2, -(-(256 << 20) // (n * k * 2)))  # >= 256 MiB of weights: five times the H100's L2
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            reference = F.linear(x, weights[0]).float()
            default = timed_us(lambda i: torch.mm(x, weights[i].t(), out=y), copies)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            torch_lt = timed_us(lambda i: torch.mm(x, weights[i].t(), out=y), copies)
            torch.backends.cuda.preferred_blas_library("cublas")
            found = ext.candidates(m, n, k, args.candidates, WORKSPACE)
            results = []
            for j, algo in enumerate(found):
                try:
                    us = timed_us(lambda i, a=algo: ext.matmul(x, weights[i], y, a, workspace), copies)
                    ext.matmul(x, weights[0], y, algo, workspace)
                    err = (y.float() - reference).abs().max().item()
                except RuntimeError as e:  # an algorithm this shape cannot run after all: recorded, the others go on
                    us, err = float("nan"), f"failed: {str(e)[:160]}"
                results.append({"index": j, "us": us, "max_abs_diff": err, "workspace": int(algo[-1])})
            ok = [r for r in results if r["us"] == r["us"]]
            best = min(ok, key=lambda r: r["us"])
            gbs = lambda us: (n * k + m * k + m * n) * 2 / us / 1e3  # noqa: E731
            rows.append([proj, m, default, torch_lt, ok[0]["us"], best["us"], best["index"], len(found),
                         default / best["us"], gbs(default), gbs(best["us"])])
            raw.append({"proj": proj, "n": n, "k": k, "m": m, "copies": copies, "default_us": default,
                        "torch_cublaslt_us": torch_lt, "candidates": results})
            print(rows[-1], flush=True)
            times = step.setdefault(m, [0.0, 0.0])
            weight = 1 if proj == "lm_head" else LAYERS
            times[0] += weight * default
            times[1] += weight * best["us"]
        del weights
    report.write(args.name, ["proj", "rows", "F.linear us", "torch Lt us", "Lt first us", "Lt best us", "best #",
                             "candidates", "F.linear / best", "F.linear GB/s", "best GB/s"], rows,
                 {"shapes": SHAPES, "workspace_bytes": WORKSPACE, "raw": raw,
                  "decode_step_ms": {m: {"default": t[0] / 1e3, "best": t[1] / 1e3} for m, t in step.items()}})
    for m, (d, b) in step.items():
        print(f"a step of {m} rows: matmuls {d / 1e3:.3f} ms with F.linear, {b / 1e3:.3f} ms with the best ({d / b:.3f}x)")


if __name__ == "__main__":
    main()
