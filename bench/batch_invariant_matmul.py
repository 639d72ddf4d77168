"""The batch-invariant matmul (``worker/batch_invariant.py``) against cuBLAS on ``llama-3-8b``'s projections, at the
row counts the engine's steps meet: decode batches (1-256 rows) and prefill chunks (1024-8192).

For each projection and tiling: the GPU time a call takes queued back to back (as graph replays run them), against
``F.linear``'s, and whether its rows are bit for bit those of the first kernel's tiling (128x128x64) -- tilings
whose rows are may be chosen by the row count without breaking invariance. "(used)" marks the one
``worker.batch_invariant.tiles`` picks.

    python bench/batch_invariant_matmul.py [--name batch_invariant_matmul_h100]
"""

from __future__ import annotations

import argparse
import faulthandler

import torch
import torch.nn.functional as F

import report
from timing import queued_ms
from worker.batch_invariant import Tiles, _matmul, tiles

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = (1, 16, 64, 128, 256, 1024, 4096, 8192)
REFERENCE = Tiles()  # 128x128x64, the first kernel's only tiling. BLOCK_K other than 64: does it keep the bits?
DECODE = {  # timed up to 256 rows
    "64x64x64 s4 w4": Tiles(block_m=64, block_n=64, num_warps=4, num_stages=4),
    "64x64x128 s3 w4": Tiles(block_m=64, block_n=64, block_k=128, num_warps=4),
    "16x32x64 s6 w4": Tiles(block_m=16, block_n=32, num_warps=4, num_stages=6),
    "16x32x128 s4 w4": Tiles(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4),
    "16x32x256 s3 w4": Tiles(block_m=16, block_n=32, block_k=256, num_warps=4),
    "16x64x128 s4 w4": Tiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
    "32x32x32 s8 w2": Tiles(block_m=32, block_n=32, block_k=32, num_warps=2, num_stages=8),
    "tma 64x64x128 s4 w4": Tiles(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4, tma=True),
}
PREFILL = {  # timed from 256 rows
    "128x128x64 s3 w8": REFERENCE,
    "128x256x64 s3 w8": Tiles(block_n=256),
    "tma 128x256x64 s3 w8": Tiles(block_n=256, tma=True),
    "tma 128x256x64 s4 w8": Tiles(block_n=256, num_stages=4, tma=True),
    "tma 128x128x64 s4 w8": Tiles(num_stages=4, tma=True),
    "tma pers 128x256x64 s3 w8": Tiles(block_n=256, tma=True, persistent=True),
}
CANDIDATES = {**DECODE, **PREFILL}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="batch_invariant_matmul")
    parser.add_argument("--tilings", default="", help="time only the tilings whose names contain this")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(90, repeat=True)  # a kernel that hangs shows where
    torch.manual_seed(0)
    rows, raw = [], []
    for proj, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        x_all = torch.randn(max(ROWS), k, dtype=torch.bfloat16, device="cuda")
        for m in ROWS:
            x = x_all[:m]
            base = _matmul(x, weight, None, REFERENCE)
            cublas = queued_ms(lambda x=x, w=weight: F.linear(x, w))
            chosen = tiles(m)
            timed = [(f"{name}{' (used)' if t == chosen else ''}", t) for name, t in CANDIDATES.items()
                     if ((name in DECODE and m <= 256) or (name in PREFILL and m >= 256)) and args.tilings in name]
            for name, t in timed:
                try:
                    ms = queued_ms(lambda x=x, w=weight, t=t: _matmul(x, w, None, t))
                    same = torch.equal(_matmul(x, weight, None, t), base)
                except Exception as e:  # noqa: BLE001 -- a tiling this Triton or this GPU cannot run: recorded, the others go on
                    ms, same = float("nan"), f"failed: {type(e).__name__}: {str(e)[:200]}"
                rows.append([proj, m, name, cublas * 1e3, ms * 1e3, ms / cublas, same])
                raw.append({"proj": proj, "n": n, "k": k, "m": m, "tiling": name, "used": t == chosen, "cublas_ms": cublas,
                            "ms": ms, "bitwise_equal": same})
                print(rows[-1], flush=True)
    report.write(args.name, ["proj", "rows", "tiling", "cuBLAS us", "Triton us", "x cuBLAS", "rows = default's"], rows,
                 {"shapes": SHAPES, "tilings": {k: vars(v) for k, v in CANDIDATES.items()}, "raw": raw})


if __name__ == "__main__":
    main()
