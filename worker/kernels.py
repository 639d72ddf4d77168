"""Fused kernels for CUDA (Triton): RMSNorm with the residual add before it, SiLU-and-mul, RoPE on q and k in
place, the new K/V rows stored into the cache in one launch, the sampler's draw over a whole batch, and the
repetition / frequency / presence penalties in one pass over the logits.

Unfused, these were a third of a prefill step's kernel time and a tenth of a decode step's on the H100
(``bench/results/step_profile_h100.json``: RMSNorm alone was six kernels, RoPE five per tensor). RMSNorm and
SiLU-and-mul round where the torch expressions beside them round (within two ulps of them: the float32 sum runs
in another order); RoPE rounds once where torch rounds three times. The torch expressions run on CPU, without
Triton, and the GPU tests hold the kernels to them and to float64.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU machines: the torch expressions below
    triton = None


#: ``VATTN_TRITON=0`` runs the torch expressions on CUDA too (an A/B switch for benchmarks and bisecting).
ENABLED = triton is not None and os.environ.get("VATTN_TRITON", "1") != "0"


#: Warps of a row's RMSNorm: the order its sum of squares is added in, which the TP all-reduce's fused norm
#: (``worker.peer_all_reduce``) shares so that both give the same bits.
RMS_NORM_WARPS = 4


def fused(x: torch.Tensor) -> bool:
    """Whether ``x``'s op runs as a Triton kernel."""
    return ENABLED and x.is_cuda


# -- RMSNorm --------------------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as transformers computes it: normalised in float32, scaled in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``rms_norm(x)``; with ``residual``, ``(x + residual, rms_norm(x + residual))`` in one pass."""
    if not fused(x):
        if residual is None:
            return rms_norm_reference(x, weight, eps)
        h = x + residual
        return h, rms_norm_reference(h, weight, eps)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()  # the kernel reads a row's elements side by side
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # contiguous: the kernel writes rows n apart
    h = torch.empty_like(out) if residual is not None else out
    r = residual.reshape(-1, x.shape[-1]).contiguous() if residual is not None else x2
    n = x2.shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](x2, r, weight, out, h, x2.stride(0), r.stride(0), n, eps,
                                     HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
                                     num_warps=RMS_NORM_WARPS)
    if residual is None:
        return out.view_as(x)
    return h.view_as(x), out.view_as(x)


# -- SiLU and mul ---------------------------------------------------------------------------------
def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` along the last dimension."""
    if not fused(gate_up):
        return silu_mul_reference(gate_up)
    x = gate_up.reshape(-1, gate_up.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


# -- RoPE -----------------------------------------------------------------------------------------
def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` (the HF half-split layout, in x's dtype as HF does)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_qk(qkv: torch.Tensor, n_q: int, n_kv: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor):
    """q and k of the fused projection ``qkv`` ``[tokens, (n_q + 2 n_kv) head_dim]`` rotated (cos, sin:
    ``[tokens, 1, head_dim]``, the first half repeated); returns views ``q [tokens, n_q, head_dim]`` and
    ``k [tokens, n_kv, head_dim]``. Fused, in place in ``qkv``."""
    q, k = qkv[:, : n_q * head_dim], qkv[:, n_q * head_dim: (n_q + n_kv) * head_dim]
    q, k = q.view(-1, n_q, head_dim), k.view(-1, n_kv, head_dim)
    half = head_dim // 2
    # The kernel spans half a head in one power-of-two block (Triton's aranges): other head dims (80, 100) and
    # strided rows take the torch expression.
    if not fused(qkv) or half & (half - 1) or qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    heads = n_q + n_kv  # k's heads follow q's in each row: one launch rotates both
    if qkv.shape[0]:
        _rope_kernel[(qkv.shape[0],)](qkv, cos, sin, qkv.stride(0), cos.stride(0), sin.stride(0), heads,
                                      HALF=half, BLOCK_H=triton.next_power_of_2(heads))
    return q, k


# -- K/V into the cache -----------------------------------------------------------------------------


def address(rows: torch.Tensor) -> int:
    """``rows``' device address as a plain int, for a Triton kernel argument that points into the virtual KV cache
    (the kernel casts it back: ``tl.pointer_type``). Triton asks the driver about every tensor argument's address
    before a launch, and a cache's first row may lie on an unbacked page -- its slot holds none and no zero page is
    under it (``zero_unmapped=False``, or guard pages only) -- which fails that check ("cannot be accessed from
    Triton") though the kernel touches only backed rows."""
    return rows.data_ptr()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor) -> None:
    """``k_rows[rows] = k; v_rows[rows] = v`` (``[tokens, H, D]`` into ``[cache rows, H, D]``): one launch for
    both where every token's heads lie side by side (two index_put kernels at ~3x the bytes' time otherwise)."""
    tokens = k.shape[0]
    n = k.shape[1] * k.shape[2]
    side_by_side = all(t.stride(-1) == 1 and t.stride(-2) == k.shape[2] and t.dtype == k.dtype for t in (v, k_rows, v_rows, k))
    if not fused(k) or not side_by_side:
        k_rows[rows] = k
        v_rows[rows] = v
        return
    if tokens:
        _store_kv_kernel[(tokens,)](k, v, address(k_rows), address(v_rows), rows, k.stride(0), v.stride(0),
                                    k_rows.stride(0), v_rows.stride(0), n, BLOCK=triton.next_power_of_2(n))


# -- sampling -------------------------------------------------------------------------------------
# A draw is the Gumbel-max trick, argmax(logits / T + Gumbel noise), which is a draw from softmax(logits / T), with
# the noise a hash of (the row's two key words, the token id): a pure function of what names the draw, so a seeded
# request gets the same tokens whatever else is in the batch and on every rank, with no generator state per row.
# Every product below stays under 2**63 (int64 on CPU); the kernel's uint32 arithmetic wraps to the same values.
_MASK32 = 0xFFFFFFFF
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B1, 0x7FEB352D, 0x2C1B3C6D


def _mix_reference(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 16)


def gumbel_argmax_reference(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """For each row of ``logits`` ``[rows, vocab]``: argmax of logits / temperature ``[rows]`` plus the Gumbel
    noise its ``keys`` ``[rows, 2]`` (int64 words under 2**32) name."""
    ids = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int64)
    h = _mix_reference(_mix_reference((ids * _GOLDEN + keys[:, :1]) & _MASK32) ^ keys[:, 1:])
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    inv_t = 1.0 / temperature  # a product, as the kernel takes it
    return (logits.float() * inv_t[:, None] - torch.log(-torch.log(u))).argmax(-1)


_DRAW_BLOCK = 4096


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, *,
                  parts: int | None = None) -> torch.Tensor:
    """``gumbel_argmax_reference`` in one pass over the logits on CUDA (the reference makes ~20 passes over
    ``[rows, vocab]`` int64 tensors: milliseconds at 256 rows of a 128K vocabulary).

    Each row's vocabulary is cut into parts, enough programs to fill the device, each part's best (score, id) kept,
    then the parts' best taken: one program a row walked 128K ids alone, 0.11-0.14 ms of device time whatever the
    batch, where the parts take 0.01-0.04 ms up to 64 rows (H200, ``bench/results/sampling_parts_h200.json``). The
    argmax is exact, a tie going to the first id, so the token does not depend on how the row was cut, nor on the
    batch. ``parts``: cut each row in at most this many (None: enough
    to fill the device; 1: one program a row, as before, for ``bench/sampling.py``)."""
    if not fused(logits) or logits.stride(-1) != 1:
        return gumbel_argmax_reference(logits, temperature, keys)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        blocks = triton.cdiv(vocab, _DRAW_BLOCK)
        parts = parts or max(1, 4 * sm_count(logits.device) // rows)
        chunk = triton.cdiv(blocks, min(blocks, parts)) * _DRAW_BLOCK
        parts = triton.cdiv(vocab, chunk)
        best = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
        best_id = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
        _gumbel_part_kernel[(rows, parts)](logits, temperature, keys.contiguous(), best, best_id, logits.stride(0),
                                           vocab, chunk, parts, BLOCK=_DRAW_BLOCK)
        _gumbel_pick_kernel[(rows,)](best, best_id, out, parts, vocab, PARTS=triton.next_power_of_2(parts))
    return out


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors: how many programs fill it."""
    return torch.cuda.get_device_properties(device).multi_processor_count


# -- penalties ------------------------------------------------------------------------------------


def penalize_reference(logits: torch.Tensor, at: torch.Tensor, penalties: torch.Tensor, counts: torch.Tensor,
                       prompt: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[rows, width]`` with row r penalized by its sequence's row ``at[r]`` of ``counts`` ``[seqs,
    vocab]`` (int32: each token's count in the output) and ``prompt`` ``[seqs, vocab]`` (bool: in the prompt), and
    its ``penalties[r]`` = (repetition, frequency, presence): a positive logit of a token seen anywhere divided by
    the repetition penalty, a negative one multiplied; then frequency x count and presence once if counted at all
    subtracted. Rows with ``at`` -1, and columns past ``vocab``, are left as they are. A new tensor."""
    vocab = counts.shape[1]
    on = at >= 0
    c = counts[at.clamp(min=0)] * on[:, None]  # an unpenalized row: counts 0, nothing seen, penalties (1, 0, 0)
    seen = (c > 0) | (prompt[at.clamp(min=0)] & on[:, None])
    repetition, frequency, presence = (penalties[:, i : i + 1].to(logits.dtype) for i in range(3))
    x = logits[:, :vocab]
    scale = torch.where(seen, repetition, torch.ones_like(repetition))
    x = torch.where(x > 0, x / scale, x * scale) - frequency * c - presence * (c > 0)
    out = logits.clone()
    out[:, :vocab] = torch.where(on[:, None], x, logits[:, :vocab])
    return out


def penalize(logits: torch.Tensor, at: torch.Tensor, penalties: torch.Tensor, counts: torch.Tensor,
             prompt: torch.Tensor) -> torch.Tensor:
    """``penalize_reference`` in one pass on CUDA: each block of the logits read once with its counts and prompt
    flags and written once (the torch expressions make ~15 passes over ``[rows, vocab]``: ~1 ms a step at 128 rows
    of a 128K vocabulary, 3.7% of W1 on the H100, ``bench/results/sampling_costs_h100.json``)."""
    if not fused(logits) or logits.stride(-1) != 1 or not counts.is_contiguous() or not prompt.is_contiguous():
        return penalize_reference(logits, at, penalties, counts, prompt)
    rows, width = logits.shape
    out = torch.empty_like(logits)
    block = 2048
    if rows:
        _penalize_kernel[(rows, triton.cdiv(width, block))](
            logits, out, at.contiguous(), penalties.to(torch.float32).contiguous(), counts, prompt.view(torch.uint8),
            logits.stride(0), width, counts.shape[1], BLOCK=block)
    return out


if triton is not None:

    @triton.jit
    def _penalize_kernel(logits_ptr, out_ptr, at_ptr, pen_ptr, counts_ptr, prompt_ptr, stride, width, vocab,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        x = tl.load(logits_ptr + row * stride + cols, mask=inside)
        at = tl.load(at_ptr + row)
        if at >= 0:
            known = cols < vocab
            c = tl.load(counts_ptr + at * vocab + cols, mask=known, other=0)
            seen = (c > 0) | (tl.load(prompt_ptr + at * vocab + cols, mask=known, other=0) != 0)
            repetition = tl.load(pen_ptr + 3 * row)
            frequency = tl.load(pen_ptr + 3 * row + 1)
            presence = tl.load(pen_ptr + 3 * row + 2)
            xf = x.to(tl.float32)
            scale = tl.where(seen, repetition, 1.0)
            y = tl.where(xf > 0, xf / scale, xf * scale) - frequency * c.to(tl.float32) - presence * (c > 0).to(tl.float32)
            x = tl.where(known, y, xf).to(x.dtype)
        tl.store(out_ptr + row * stride + cols, x, mask=inside)

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_at, vc_at, rows_ptr, stride_k, stride_v, stride_kc, stride_vc, n,
                         BLOCK: tl.constexpr):
        kc_ptr = kc_at.to(tl.int64).to(tl.pointer_type(k_ptr.dtype.element_ty))  # the cache's rows: ``address``
        vc_ptr = vc_at.to(tl.int64).to(tl.pointer_type(v_ptr.dtype.element_ty))
        tok = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + tok).to(tl.int64)  # row * stride passes 2**31 in a large cache
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        tl.store(kc_ptr + row * stride_kc + cols, tl.load(k_ptr + tok * stride_k + cols, mask=mask), mask=mask)
        tl.store(vc_ptr + row * stride_vc + cols, tl.load(v_ptr + tok * stride_v + cols, mask=mask), mask=mask)

    @triton.jit
    def add_residual(x, r):
        """A row plus its residual: the residual stream stays in x's dtype."""
        return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)

    @triton.jit
    def rms_norm_row(x, w, n, eps):
        """One row's RMSNorm, ``w`` the weight's row: the bits of every norm kernel here, and of the TP all-reduce's
        fused one (``worker.peer_all_reduce``), launched with ``RMS_NORM_WARPS``."""
        xf = x.to(tl.float32)
        y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)).to(x.dtype)
        return (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, stride_x, stride_r, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in long prefills
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = add_residual(x, tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0))
            tl.store(h_ptr + row * n + cols, x, mask=mask)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * n + cols, rms_norm_row(x, w, n, eps), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        silu = libdevice.div_rn(g, 1.0 + libdevice.exp(-g)).to(gate.dtype)  # IEEE exp and division, as torch's
        tl.store(out_ptr + row * n + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_x, stride_cos, stride_sin, heads,
                     HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, HALF)[None, :]
        mask = h < heads
        first = x_ptr + tok * stride_x + h * (2 * HALF) + d
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + HALF, mask=mask, other=0.0)
        cos = tl.load(cos_ptr + tok * stride_cos + d).to(tl.float32)
        sin = tl.load(sin_ptr + tok * stride_sin + d).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate(x) * sin in float32, rounded once (torch rounds each product too: less exact)
        tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
        tl.store(first + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)

    @triton.jit
    def _mix(x):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x2C1B3C6D
        return x ^ (x >> 16)

    @triton.jit
    def _gumbel_part_kernel(logits_ptr, temp_ptr, keys_ptr, best_ptr, best_id_ptr, stride, vocab, chunk, parts,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        inv_t = 1.0 / tl.load(temp_ptr + row)
        k0 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
        k1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_id = tl.zeros([BLOCK], tl.int32)
        for start in range(part * chunk, tl.minimum(part * chunk + chunk, vocab), BLOCK):
            ids = start + tl.arange(0, BLOCK)
            mask = ids < vocab
            x = tl.load(logits_ptr + row * stride + ids, mask=mask, other=float("-inf")).to(tl.float32)
            h = _mix(_mix(ids.to(tl.uint32) * 0x9E3779B1 + k0) ^ k1)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = tl.where(mask, x * inv_t - tl.log(-tl.log(u)), float("-inf"))
            better = score > best  # the first block's id wins a tie, as argmax's first index does
            best = tl.where(better, score, best)
            best_id = tl.where(better, ids, best_id)
        top = tl.max(best, 0)
        tl.store(best_ptr + row * parts + part, top)
        tl.store(best_id_ptr + row * parts + part, tl.min(tl.where(best == top, best_id, vocab), 0))

    @triton.jit
    def _gumbel_pick_kernel(best_ptr, best_id_ptr, out_ptr, parts, vocab, PARTS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        at = tl.arange(0, PARTS)
        best = tl.load(best_ptr + row * parts + at, mask=at < parts, other=float("-inf"))
        best_id = tl.load(best_id_ptr + row * parts + at, mask=at < parts, other=vocab)
        top = tl.max(best, 0)
        # a part's id is its first best one, and the parts go in id order: the first among the best parts' is the row's
        tl.store(out_ptr + row, tl.min(tl.where(best == top, best_id, vocab), 0).to(tl.int64))
