"""The Lamport all-reduce's kernels under Triton's interpreter, one rank on CPU tensors (where Triton is installed:
the GPU machines; the CPU suite skips): the protocol a rank runs alone -- its part through its own buffer, the call
counter, the call before's buffer set back to the sentinel whatever the sizes, a part's -0 sent as +0 -- and the fused
sum, residual add and RMSNorm against the norm's own kernel, bit for bit (float16: the interpreter rounds bfloat16 its
own way).
The two-rank sums run on two GPUs in ``test_peer_all_reduce.py``. In a process of its own: the interpreter is chosen
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
    buf = torch.full((3 * N,), par.SENTINEL, dtype=torch.int16)
    state = torch.zeros(3, dtype=torch.int64)
    lamport = par.LamportState(torch.tensor([buf.data_ptr()], dtype=torch.int64), state, 0, 1, N)
    g = torch.Generator().manual_seed(0)
    calls = 0
    for n in (8192, 16, 4096, 8, 40000):
        x = torch.randn(n, generator=g).to(torch.float16)
        x[:3] = -0.0
        y = x.clone()
        lamport.all_reduce(y)
        calls += 1
        assert torch.equal(y, x) and (y[:3].view(torch.int16) == 0).all()  # one rank's sum; -0 sent as +0
        assert state.tolist() == [calls, 0, n], state
        assert (buf.view(3, N)[(calls + 1) % 3] == par.SENTINEL).all()  # all of the call before's buffer, reset
    for rows, hidden in ((4, 256), (1, 512), (3, 4096)):
        x = torch.randn(rows, hidden, generator=g).to(torch.float16)
        residual = torch.randn(rows, hidden, generator=g).to(torch.float16)
        weight = torch.randn(hidden, generator=g).to(torch.float16)
        h, out = torch.empty_like(x), torch.empty_like(x)
        lamport.all_reduce_norm(x, residual, weight, 1e-5, h, out)
        calls += 1
        want_h, want = torch.empty_like(x), torch.empty_like(x)  # the norm's own kernel, after the sum
        kernels._rms_norm_kernel[(rows,)](x, residual, weight, want, want_h, hidden, hidden, hidden, 1e-5,
                                          HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(hidden))
        assert torch.equal(h, want_h) and torch.equal(out, want)
        assert (out.float() - rms_norm_reference(x + residual, weight, 1e-5).float()).abs().max() < 2e-3
        assert state.tolist() == [calls, 0, rows * hidden], state
    print("ok")
""")


def test_the_lamport_kernels_protocol_and_fused_norm_on_one_rank():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
