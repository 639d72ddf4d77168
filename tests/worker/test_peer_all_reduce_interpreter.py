"""The Lamport all-reduce's kernels under Triton's interpreter, on CPU tensors (where Triton is installed: the GPU
machines; the CPU suite skips), both ranks of a pair in one process -- rank 1's part written first, then rank 0's
call, then rank 1's, which finds rank 0's part where rank 0's call put it: the protocol -- each part in the other
rank's buffer only, the call counter, the call before's buffer set back to the sentinel whatever the sizes, a part's
-0 sent as +0, both ranks' sums the same bits -- and the fused sum, residual add and RMSNorm against the norm's own
kernel, bit for bit (float16: the interpreter rounds bfloat16 its own way).
The sums between two GPUs run in ``test_peer_all_reduce.py``. In a process of its own: the interpreter is chosen
when the kernels are defined."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import triton
    import worker.peer_all_reduce as par
    from worker import kernels
    from worker.kernels import rms_norm_reference

    N = 1 << 16
    SENT = par.SENTINEL
    bufs = [torch.full((3 * 2 * N,), SENT, dtype=torch.int16) for _ in range(2)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    states = [torch.zeros(3, dtype=torch.int64) for _ in range(2)]
    ranks = [par.LamportState(ptrs, states[r], r, 2, N) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    calls = 0

    def regions(rank):  # [buffer, region, element]
        return bufs[rank].view(3, 2, N)

    def sent(x):  # a part as it travels: -0 as +0
        bits = x.reshape(-1).view(torch.int16)
        return torch.where(bits == SENT, torch.zeros_like(bits), bits)

    def pair(xs, run):
        \"\"\"Rank 1's part into rank 0's buffer (what rank 1's call sends first), rank 0's call, rank 1's call.\"\"\"
        global calls
        use, n = calls % 3, xs[0].numel()
        regions(0)[use, 1, :n] = sent(xs[1])
        outs = [run(0, xs[0]), run(1, xs[1])]
        calls += 1
        for r in range(2):
            assert states[r].tolist() == [calls, 0, n], states[r]
            other = 1 - r
            assert torch.equal(regions(other)[use, r, :n], sent(xs[r]))  # the part, in the other rank's buffer
            assert (regions(r)[:, r] == SENT).all()  # and never in its own
            assert (regions(r)[(use + 2) % 3] == SENT).all()  # all of the call before's buffer, reset
        return outs

    for n in (8192, 16, 4096, 8, 40000):
        xs = [torch.randn(n, generator=g).to(torch.float16) for _ in range(2)]
        xs[0][:3] = -0.0
        xs[1][1:5] = -0.0
        def run(rank, x):
            y = x.clone()
            ranks[rank].all_reduce(y)
            return y
        y0, y1 = pair(xs, run)
        want = sum(sent(x).view(torch.float16).float() for x in xs).to(torch.float16)  # in float32, rounded once
        assert all(torch.equal(y.view(torch.int16), want.view(torch.int16)) for y in (y0, y1))
    for rows, hidden in ((4, 256), (1, 512), (3, 4096)):
        xs = [torch.randn(rows, hidden, generator=g).to(torch.float16) for _ in range(2)]
        residual = torch.randn(rows, hidden, generator=g).to(torch.float16)
        weight = torch.randn(hidden, generator=g).to(torch.float16)
        def run(rank, x):
            h, out = torch.empty_like(x), torch.empty_like(x)
            ranks[rank].all_reduce_norm(x, residual, weight, 1e-5, h, out)
            return h, out
        (h0, out0), (h1, out1) = pair(xs, run)
        total = (xs[0].float() + xs[1].float()).to(torch.float16)
        want_h, want = torch.empty_like(total), torch.empty_like(total)  # the norm's own kernel, after the sum
        kernels._rms_norm_kernel[(rows,)](total, residual, weight, want, want_h, hidden, hidden, hidden, 1e-5,
                                          HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(hidden))
        assert torch.equal(h0, want_h) and torch.equal(out0, want) and torch.equal(h1, h0) and torch.equal(out1, out0)
        assert (out0.float() - rms_norm_reference(total + residual, weight, 1e-5).float()).abs().max() < 2e-3
    print("ok")
""")


def test_the_lamport_kernels_protocol_and_fused_norm_on_a_pair_of_ranks():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
