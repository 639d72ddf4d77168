"""Physical / used KV memory for 128 requests, per model shape, TP degree and cache layout.

Pure accounting from ``KVCacheSpec`` (the same geometry the caches map by; tests check that the
caches map exactly ``spec.physical_bytes_for``): lengths uniform in [256, 8192], fixed seed.

    python bench/fragmentation.py [--requests 128] [--seed 0] [--out bench/results]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import report  # noqa: E402
from kvmem import KVCacheSpec  # noqa: E402
from worker.config import PRESETS  # noqa: E402

MODELS = {  # name: (layers, KV heads, head dim), from the presets
    name: (PRESETS[preset].num_layers, PRESETS[preset].num_kv_heads, PRESETS[preset].head_dim)
    for name, preset in {"Llama-3-8B": "llama-3-8b", "Yi-6B": "yi-6b", "Yi-34B": "yi-34b"}.items()
}
LAYOUTS = {"per_layer@2MiB": ("per_layer", 2 << 20), "mega@2MiB": ("mega", 2 << 20), "paged@16": ("paged", 16)}
MEGA_LIMIT = 1.05


def ratio(lengths: list[int], layers: int, heads: int, head_dim: int, layout: str, page: int) -> float:
    spec = KVCacheSpec(layers, heads, head_dim, torch.bfloat16, len(lengths), max(lengths), layout, page)
    physical = sum(spec.physical_bytes_for(n) for n in lengths)
    return physical / (sum(lengths) * spec.bytes_per_token)


def plot(rows: list[list], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(LAYOUTS)
    for j, name in enumerate(LAYOUTS):
        ax.bar([i + j * width for i in range(len(rows))], [r[2 + j] for r in rows], width, label=name)
    ax.axhline(MEGA_LIMIT, color="k", ls="--", lw=0.8, label=f"{MEGA_LIMIT} (mega target)")
    ax.set_xticks([i + width for i in range(len(rows))], [f"{r[0]}\nTP{r[1]}" for r in rows])
    ax.set_ylabel("physical / used KV bytes")
    ax.set_ylim(0.95, max(max(r[2:]) for r in rows) * 1.05)
    ax.set_title("KV memory overhead, 128 requests, lengths U[256, 8192]")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lengths = [rng.randint(256, 8192) for _ in range(args.requests)]
    rows = []
    for model, (layers, heads, head_dim) in MODELS.items():
        for tp in (1, 2):
            rows.append([model, tp] + [ratio(lengths, layers, heads // tp, head_dim, *LAYOUTS[n]) for n in LAYOUTS])
    report.write("fragmentation", ["model", "TP", *LAYOUTS], rows, {"seed": args.seed, "lengths": lengths}, args.out)
    plot(rows, args.out / "fragmentation.png")
    worst = max(r[3] for r in rows)
    print(f"mega@2MiB worst ratio {worst:.4f} ({'within' if worst <= MEGA_LIMIT else 'ABOVE'} {MEGA_LIMIT})")


if __name__ == "__main__":
    main()
