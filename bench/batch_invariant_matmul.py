"""The batch-invariant matmul (``worker/batch_invariant.py``) against cuBLAS on ``llama-3-8b``'s projections, at the
row counts the engine's steps meet: decode batches (1-256 rows) and prefill chunks (1024-8192).

For each projection and tiling: the GPU time a call takes queued back to back (as graph replays run them), against
``F.linear``'s, and whether its rows are bit for bit those of the default tiling -- a tiling whose rows are may be
chosen by the row count without breaking invariance.

    python bench/batch_invariant_matmul.py [--name batch_invariant_matmul_h100]
"""

from __future__ import annotations

import argparse

import report
import torch
import torch.nn.functional as F
from timing import queued_ms

from worker.batch_invariant import TILES, Tiles, _matmul

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = (1, 16, 64, 128, 256, 1024, 4096, 8192)
TILINGS = {
    "128x128x64 (default)": TILES,
    "64x128x64": Tiles(block_m=64, num_warps=4),
    "64x64x64": Tiles(block_m=64, block_n=64, num_warps=4, num_stages=4),
    "16x64x64": Tiles(block_m=16, block_n=64, num_warps=4, num_stages=4),
    "128x256x64": Tiles(block_n=256, num_stages=3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="batch_invariant_matmul")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, raw = [], []
    for proj, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        x_all = torch.randn(max(ROWS), k, dtype=torch.bfloat16, device="cuda")
        for m in ROWS:
            x = x_all[:m]
            base = _matmul(x, weight, None)
            cublas = queued_ms(lambda x=x, w=weight: F.linear(x, w))
            for name, tiles in TILINGS.items():
                ms = queued_ms(lambda x=x, w=weight, t=tiles: _matmul(x, w, None, t))
                same = torch.equal(_matmul(x, weight, None, tiles), base)
                rows.append([proj, m, name, cublas * 1e3, ms * 1e3, ms / cublas, same])
                raw.append({"proj": proj, "n": n, "k": k, "m": m, "tiling": name, "cublas_ms": cublas, "ms": ms,
                            "bitwise_equal": same})
            print(rows[-len(TILINGS):], flush=True)
    report.write(args.name, ["proj", "rows", "tiling", "cuBLAS us", "Triton us", "x cuBLAS", "rows = default's"], rows,
                 {"shapes": SHAPES, "tilings": {k: vars(v) for k, v in TILINGS.items()}, "raw": raw})


if __name__ == "__main__":
    main()
