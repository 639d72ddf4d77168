"""Batch-invariant matmul for ``deterministic=True``: a row's result is a function of that row and the weights alone,
never of how many rows share the call or where the row sits among them.

A library matmul is not: BLAS and cuBLAS pick their kernel, tiling and split of the reduction by the problem's
shape, so one row's sums run in another order, and round otherwise, in another batch (on this CPU, a row of a
4096 x 1024 float32 product differs in 3,143 of its 4,096 values between a call of one row and a call of two).

- CUDA: one Triton kernel whose tiles and reduction order are constants -- every output element sums its K
  products in ``BLOCK_K`` steps from 0 up, whatever M is (no split-K, no autotuning, M not specialised on).
- CPU: the library's product over blocks of exactly ``CPU_ROWS`` rows, the last one padded: every call has the same
  shape, so the library takes the same path for each, and a row's result does not depend on its place in the
  block (the test suite checks both on the machine it runs on). It does depend on the thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the blocked library product
    triton = None

CPU_ROWS = 16


@dataclass(frozen=True)
class Tiles:
    """The CUDA kernel's launch constants. Only ``block_k`` (with the instruction ``tl.dot`` picks) sets a row's
    reduction order; the others set how the work is cut and scheduled."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


TILES = Tiles()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x`` ``[..., K]``, ``weight`` ``[N, K]``), batch-invariant."""
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda and triton is not None:
        out = _matmul(rows, weight, bias)
    else:
        out = _blocked(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n = x.shape[0]
    pad = -n % CPU_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    # One call a block: a single call over all of them would be one product of another shape again.
    out = torch.cat([F.linear(block, weight, bias) for block in x.split(CPU_ROWS)]) if len(x) else F.linear(x, weight, bias)
    return out[:n]


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: float32 products in full (Triton's default rounds their inputs to TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles = TILES) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
        _matmul_kernel[grid](x, weight, bias if bias is not None else x, out, m, n, k,
                             x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
                             HAS_BIAS=bias is not None, PRECISION=precision(x.dtype), BLOCK_M=tiles.block_m,
                             BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
                             num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


if triton is not None:

    # M is not specialised on: a row count divisible by 16 must not compile another kernel than one that is not.
    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_wn, stride_wk, stride_cm,
                       HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        # Groups of GROUP_M row tiles walk the columns together: their weight tiles are read once into L2.
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
        w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=(rows[:, None] < M) & (ks[None, :] < K - k0), other=0.0)
            w = tl.load(w_ptrs, mask=(ks[:, None] < K - k0) & (cols[None, :] < N), other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))
