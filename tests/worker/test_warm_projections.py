"""The projections' warm-up (``worker.runner.warm_projections``): the row counts it runs, every distinct shape once
at each, and on a GPU, in a fresh process, that an eager step's product at a row count never seen then starts
without cuBLAS first loading a kernel for it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import cuda_missing
from worker.config import PRESETS
from worker.model import Block
from worker.parallel import TPGroup
from worker.runner import warm_projections, warm_row_counts


def test_row_counts_grow_by_a_quarter_up_to_the_most_a_step_takes():
    assert warm_row_counts(100) == [16, 20, 25, 31, 39, 49, 61, 76, 95, 100]
    assert warm_row_counts(16) == [16]
    counts = warm_row_counts(8192)
    assert counts[-1] == 8192 and len(counts) == 29
    assert all(1.2 < b / a <= 1.3 for a, b in zip(counts, counts[1:-1]))


def test_each_distinct_projection_shape_runs_once_at_each_count():
    layers = torch.nn.ModuleList(Block(PRESETS["tiny"], j, TPGroup()) for j in range(2))
    # QKV, output, gate/up and down: four shapes, whichever layer they are in
    assert warm_projections(layers, 40) == 4 * len(warm_row_counts(40))


def _first_products(out: str, warm: bool) -> None:
    """Host milliseconds of the first product of each of llama-3-8b's projections (TP=2 shapes) at row counts a
    warm-up of 8192 rows never ran, in this fresh process; ``warm``: after the warm-up."""
    c = PRESETS["llama-3-8b"]
    shapes = [((c.num_heads + 2 * c.num_kv_heads) * c.head_dim // 2, c.hidden_size),
              (c.hidden_size, c.num_heads * c.head_dim // 2), (c.intermediate_size, c.hidden_size),
              (c.hidden_size, c.intermediate_size // 2)]
    weights = [torch.zeros(n, k, dtype=torch.bfloat16, device="cuda") for n, k in shapes]
    if warm:
        warm_projections(torch.nn.ModuleList(_as_linear(w) for w in weights), 8192)
    torch.cuda.synchronize()
    times = {}
    for rows in (100, 333, 1138, 3001, 4011, 5555, 7777):
        for (n, k), w in zip(shapes, weights):
            x = torch.zeros(rows, k, dtype=torch.bfloat16, device="cuda")
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times[(rows, n, k)] = 1e3 * (time.perf_counter() - start)
            torch.cuda.synchronize()
    torch.save(times, out)


def _as_linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


@pytest.mark.gpu
def test_after_the_warm_up_a_new_row_count_does_not_hold_the_launch(tmp_path):
    if cuda_missing():
        pytest.skip(cuda_missing())
    ctx = mp.get_context("spawn")
    times = {}
    for warm in (False, True):
        p = ctx.Process(target=_first_products, args=(str(tmp_path / f"{warm}.pt"), warm))
        p.start()
        p.join(300)
        assert p.exitcode == 0
        times[warm] = torch.load(tmp_path / f"{warm}.pt")
    print("cold, host ms of the slowest first products:", sorted(times[False].values())[-4:])
    print("warm:", sorted(times[True].values())[-4:])
    slow = {shape: ms for shape, ms in times[True].items() if ms > 20}
    assert not slow, f"products that still waited for a kernel after the warm-up (host ms): {slow}"
