"""Two source trees' serving paths side by side: ``bench/serving.py`` from tree A, then B, B, A (ABBA, each run a
server of its own), one table of every run and the B / A ratio of the sides' means per level.

    git worktree add /tmp/before HEAD~1
    python bench/serving_ab.py --a /tmp/before --b . --name serving_direct_ab_cpu -- --device cpu --concurrency 1 16

Everything after ``--`` goes to each ``bench/serving.py`` run (its ``--name`` and ``--out`` are this script's);
``--a-args`` / ``--b-args`` add a side's own, for one tree with two settings:

    python bench/serving_ab.py --a . --b . --b-args "--mixed-graph-tokens 2048" -- --device cuda ...
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402

#: What each level compares: (key in a level of bench/serving.py's JSON, statistic).
MEASURES = [("ttft_s", "p50"), ("ttft_s", "p90"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("e2e_s", "p50")]


def revision(tree: Path) -> str:
    """The tree's commit, ``+`` where its tracked files differ from it."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    except OSError:  # no git
        return "unknown"
    if done.returncode != 0:  # a copy without its history (the GPU machine's)
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=tree).returncode != 0
    return done.stdout.strip() + ("+" if dirty else "")


def run(tree: Path, serving_args: list[str], out: Path, name: str) -> dict:
    """``tree``'s bench/serving.py with ``serving_args``, its code on the path of the server it starts."""
    # The tree first, before whatever else the path holds (the GPU machine's Ray and kernel builds)
    env = report.tree_env(tree)
    cmd = [sys.executable, str(tree / "bench" / "serving.py"), *serving_args, "--name", name, "--out", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads((out / f"{name}.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", type=Path, required=True, help="the tree to compare against (e.g. a worktree of HEAD~1)")
    p.add_argument("--b", type=Path, required=True)
    p.add_argument("--order", default="ABBA", help="the runs, in order (each letter a side)")
    p.add_argument("--a-args", default="", help="bench/serving.py arguments for side A only (one string)")
    p.add_argument("--b-args", default="", help="... for side B only")
    p.add_argument("--name", default="serving_ab")
    p.add_argument("--out", type=Path, default=report.RESULTS)
    p.add_argument("serving_args", nargs=argparse.REMAINDER, help="-- then bench/serving.py's arguments")
    args = p.parse_args()
    serving_args = args.serving_args[1:] if args.serving_args[:1] == ["--"] else args.serving_args
    if set(args.order) - {"A", "B"} or not {"A", "B"} <= set(args.order):
        sys.exit(f"--order must use both A and B and nothing else, got {args.order!r}")
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    own = {"A": shlex.split(args.a_args), "B": shlex.split(args.b_args)}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, side in enumerate(args.order):
            result = run(trees[side], serving_args + own[side], Path(tmp), f"run{k}")
            runs.append({"side": side, "levels": result["levels"]})
    headers = ["run", "side", "level", "output tok/s", *(f"{key.removesuffix('_s')} {stat} ms" for key, stat in MEASURES)]
    rows, means = [], {}
    for k, r in enumerate(runs):
        for level in r["levels"]:
            label = f"{level['rate']:g}/s" if level["rate"] else f"{level['concurrency']} clients"
            values = [level["output_tok_s"], *(1e3 * level[key][stat] for key, stat in MEASURES)]
            rows.append([k, r["side"], label, *values])
            means.setdefault(label, {}).setdefault(r["side"], []).append(values)
    ratios = {}
    for label, sides in means.items():
        a, b = ([statistics.fmean(col) for col in zip(*sides[s])] for s in "AB")
        ratios[label] = dict(zip(headers[3:], (y / x for x, y in zip(a, b))))
        rows.append(["B / A", "", label, *ratios[label].values()])
    report.write(args.name, headers, rows, {"trees": {s: {"path": str(t), "revision": revision(t)} for s, t in trees.items()},
                                            "order": args.order, "serving_args": serving_args, "side_args": own,
                                            "runs": runs,
                                            "ratios_b_over_a": ratios}, args.out)


if __name__ == "__main__":
    main()
