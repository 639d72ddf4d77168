"""Batch-invariant matmul for ``deterministic=True``: a row's result is a function of that row and the weights alone,
never of how many rows share the call or where the row sits among them.

A library matmul is not: BLAS and cuBLAS pick their kernel, tiling and split of the reduction by the problem's
shape, so one row's sums run in another order, and round otherwise, in another batch (on this CPU, a row of a
4096 x 1024 float32 product differs in 3,143 of its 4,096 values between a call of one row and a call of two).

- CUDA: Triton kernels whose reduction order is a constant -- every output element accumulates its K products in
  one float32 accumulator, one tensor-core k-step after the other from 0 up, whatever M is (no split-K). How the
  output is cut into tiles, how many k-steps a loop iteration takes (``BLOCK_K``) and how the operands are loaded
  (pointers, or the TMA, persistent or not) do not touch that order, so the tiling is chosen by the row count
  (``tiles``): small tiles keep every SM streaming weights on a decode batch, large ones run a prefill chunk near
  cuBLAS's rate. On the H100 every tiling gave the bits of every other (``bench/results/batch_invariant_matmul_h100.json``);
  the GPU tests check the ones used here.
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
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU machines: the blocked library product
    triton = None

from worker.kernels import sm_count

CPU_ROWS = 16


@dataclass(frozen=True)
class Tiles:
    """How the CUDA kernels cut and schedule a product; none of it changes a row's sums (module docstring)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False  # operands loaded by the Hopper tensor-memory accelerator (bf16/fp16, 16-byte aligned rows)
    persistent: bool = False  # with ``tma``: one program an SM, walking the tiles


# (most rows, tiling) in order, the last one for any more rows. Measured on the H100 against cuBLAS at Llama-3-8B's
# projections (bench/results/batch_invariant_matmul_h100.json): decode batches stream the weights through many small
# tiles; prefill chunks run the persistent TMA kernel, within 10% of cuBLAS from 4096 rows.
TILINGS = (
    (32, Tiles(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3)),
    (256, Tiles(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (None, Tiles(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, tma=True, persistent=True)),
)
WIDE_TILES = Tiles()  # 4-byte operands (float32): the tiles above would overflow shared memory


def tiles(rows: int, dtype: torch.dtype = torch.bfloat16) -> Tiles:
    """The tiling of a product of ``rows`` rows of ``dtype``."""
    if dtype.itemsize > 2:
        return WIDE_TILES
    return next(t for most, t in TILINGS if most is None or rows <= most)


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


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiling: Tiles | None = None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        t = tiling or tiles(m, x.dtype)
        if t.tma and _tma_fits(x, weight):
            _matmul_tma(x, weight, bias, out, t)
            return out
        grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
        _matmul_kernel[grid](x, weight, bias if bias is not None else x, out, m, n, k,
                             x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
                             HAS_BIAS=bias is not None, PRECISION=precision(x.dtype), EVEN_K=k % t.block_k == 0,
                             BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                             num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def _tma_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The tensor-memory accelerator takes 2-byte operands whose rows start 16-byte aligned."""
    return (x.dtype in (torch.bfloat16, torch.float16) and all(t.stride(-1) == 1 and t.stride(0) % 8 == 0
            and t.data_ptr() % 16 == 0 for t in (x, weight)))


def _matmul_tma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, t: Tiles) -> None:
    m, k = x.shape
    n = weight.shape[0]
    tiles_total = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    programs = min(tiles_total, sm_count(x.device)) if t.persistent else tiles_total
    _matmul_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [t.block_m, t.block_k]), TensorDescriptor.from_tensor(weight, [t.block_n, t.block_k]),
        bias if bias is not None else x, out, m, n, k, out.stride(0), programs, HAS_BIAS=bias is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        num_warps=t.num_warps, num_stages=t.num_stages)


if triton is not None:

    # M is not specialised on: a row count divisible by 16 must not compile another kernel than one that is not.
    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_wn, stride_wk, stride_cm,
                       HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
            if EVEN_K:  # no mask along K: the loads vectorise fully
                a = tl.load(a_ptrs, mask=rows[:, None] < M, other=0.0)
                w = tl.load(w_ptrs, mask=cols[None, :] < N, other=0.0)
            else:
                a = tl.load(a_ptrs, mask=(rows[:, None] < M) & (ks[None, :] < K - k0), other=0.0)
                w = tl.load(w_ptrs, mask=(ks[:, None] < K - k0) & (cols[None, :] < N), other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit(do_not_specialize=["M", "PROGRAMS"])
    def _matmul_tma_kernel(a_desc, w_desc, bias_ptr, c_ptr, M, N, K, stride_cm, PROGRAMS, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # The same sums as _matmul_kernel's, in the same order (BLOCK_K steps from 0 up); the loads past the edges
        # read zeros.
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        # (Warp specialisation, tl.range(warp_specialize=True), hung on the H100 with Triton 3.6.)
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
            first_m = (tile // per_group) * GROUP_M
            group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
            pid_m = first_m + (tile % per_group) % group_rows
            pid_n = (tile % per_group) // group_rows
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([pid_m * BLOCK_M, k0])
                w = w_desc.load([pid_n * BLOCK_N, k0])
                acc = tl.dot(a, w.T, acc)
            rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                     mask=(rows[:, None] < M) & (cols[None, :] < N))
