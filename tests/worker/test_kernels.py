"""The fused Triton kernels against their torch expressions (GPU only), at the models' shapes and awkward ones:
RMSNorm and SiLU-and-mul within two ulps of them (the float32 sum runs in another order), RoPE at least as close
to float64 as the torch expression (it rounds once, torch three times)."""

from __future__ import annotations

import pytest
import torch

from worker import kernels
from worker.config import PRESETS, ModelConfig
from worker.rope import rope_cache, rope_for

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    torch.manual_seed(0)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of the dtype lie between ``a`` and ``b``, elementwise."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return (a.view(bits).int() - b.view(bits).int()).abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 4096), (128, 4096), (8192, 4096), (7, 3584), (3, 100)])
def test_rms_norm_with_and_without_the_residual(dtype, tokens, hidden):
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    r = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    assert kernels.fused(x)
    ulps = 2 if dtype != torch.float32 else 8  # float32 shows rsqrt's and the sum order's last bits
    out = kernels.rms_norm(x, w, 1e-5)
    assert ulps_apart(out, kernels.rms_norm_reference(x, w, 1e-5)).max() <= ulps
    h, normed = kernels.rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(h, x + r)
    assert ulps_apart(normed, kernels.rms_norm_reference(x + r, w, 1e-5)).max() <= ulps


def test_rms_norm_of_a_strided_view():
    x = torch.randn(16, 2 * 4096, device="cuda", dtype=torch.bfloat16)[:, :4096]  # rows 8192 apart
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    assert ulps_apart(kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_reference(x, w, 1e-6)).max() <= 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "inter"), [(1, 14336), (128, 14336), (4096, 14336), (5, 1000)])
def test_silu_mul(dtype, tokens, inter):
    gate_up = 4 * torch.randn(tokens, 2 * inter, device="cuda", dtype=dtype)
    got, want = kernels.silu_mul(gate_up), kernels.silu_mul_reference(gate_up)
    assert got.shape == want.shape == (tokens, inter)
    assert ulps_apart(got, want).max() <= 2


ODD_HEADS = ModelConfig(1000, 32 * 80, 100, 1, 32, 8, 80)  # head_dim 80: the torch expression takes it


@pytest.mark.parametrize("model", ["llama-3-8b", "qwen2.5-7b", "tiny", "head_dim_80"])
@pytest.mark.parametrize("tokens", [1, 128, 2049])
def test_rope_on_q_and_k_in_place_is_as_exact_as_the_reference(model, tokens):
    c = PRESETS.get(model, ODD_HEADS)
    d, n_q, n_kv = c.head_dim, c.num_heads, c.num_kv_heads
    qkv = torch.randn(tokens, (n_q + 2 * n_kv) * d, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, min(c.max_position_embeddings, 32768), (tokens,), device="cuda")
    cos, sin = rope_for(rope_cache(c, "cuda"), positions, torch.bfloat16)
    original = qkv.clone()
    q, k = kernels.rope_qk(qkv, n_q, n_kv, d, cos, sin)
    for got, columns, heads in ((q, slice(0, n_q * d), n_q), (k, slice(n_q * d, (n_q + n_kv) * d), n_kv)):
        x = original[:, columns].view(-1, heads, d)
        exact = kernels.rope_reference(x.double(), cos.double(), sin.double())
        torch_error = (kernels.rope_reference(x, cos, sin).double() - exact).abs()
        error = (got.double() - exact).abs()
        assert error.max() <= torch_error.max() and error.mean() <= torch_error.mean()
    assert torch.equal(qkv[:, (n_q + n_kv) * d:], original[:, (n_q + n_kv) * d:])  # v untouched


@pytest.mark.parametrize("tokens", [1, 37, 8192])
def test_store_kv_writes_what_index_assignment_writes(tokens):
    # k and v as the model hands them over (views of the fused projection's rows), into a layer's rows of a
    # cache that holds several layers per row, at rows out of order
    kv_heads, dim, layers, cache_rows = 8, 128, 4, 9000
    qkv = torch.randn(tokens, (32 + 2 * kv_heads) * dim, dtype=torch.bfloat16, device="cuda")
    k = qkv[:, 32 * dim: (32 + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (32 + kv_heads) * dim:].view(tokens, kv_heads, dim)
    caches = [torch.zeros(cache_rows, layers, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    rows = torch.randperm(cache_rows, device="cuda")[:tokens]
    kernels.store_kv(k, v, caches[0][:, 2], caches[1][:, 2], rows)
    caches[2][:, 2][rows] = k
    caches[3][:, 2][rows] = v
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_store_kv_writes_a_cache_whose_first_rows_are_unbacked():
    """A virtual cache without the zero page whose first slot holds no pages: Triton refuses a tensor argument on an
    unmapped address ("cannot be accessed from Triton"), so the kernel takes the cache's address as an int; the
    rows of a backed slot get the new K/V."""
    from kvmem import KVCacheSpec, VirtualKVCache
    from tests.conftest import make_vmm

    kv_heads, dim, tokens = 2, 128, 5
    spec = KVCacheSpec(2, kv_heads, dim, torch.bfloat16, 4, 1024, "per_layer", 2 << 20)
    cache = VirtualKVCache(spec, 4 * spec.physical_bytes_for(1024), make_vmm("cuda"), zero_unmapped=False)
    slot = cache.alloc_slot(slot=3)
    cache.ensure(slot, tokens)
    k, v = (torch.randn(tokens, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k_rows, v_rows = cache.rows(1)
    rows = cache.token_rows(slot, 0, tokens).to("cuda")
    kernels.store_kv(k, v, k_rows, v_rows, rows)
    assert torch.equal(k_rows[rows], k) and torch.equal(v_rows[rows], v)
    cache.close()


@pytest.mark.parametrize(("rows", "vocab"), [(1, 128256), (256, 128256), (33, 4097), (5, 7)])
def test_gumbel_argmax_draws_the_references_tokens(rows, vocab):
    from worker.sampling import noise_keys

    logits = 4 * torch.randn(rows, vocab, device="cuda")
    logits[0, 3:] = float("-inf")  # a top-k / top-p row: only its first tokens may come out
    temperature = torch.rand(rows, device="cuda") + 0.2
    keys = torch.tensor([noise_keys(7, r, 11) for r in range(rows)], dtype=torch.int64, device="cuda")
    got = kernels.gumbel_argmax(logits, temperature, keys)
    want = kernels.gumbel_argmax_reference(logits, temperature, keys)
    # The kernel's log and reciprocal may round apart from torch's: only a near tie could flip a token.
    assert (got == want).float().mean() >= 0.99 and int(got[0]) < 3


@pytest.mark.parametrize("vocab", [128256, 4097])
def test_gumbel_argmax_gives_a_row_the_same_token_in_any_batch_and_finds_it_in_any_part(vocab):
    """The vocabulary is cut into more parts the fewer the rows: a row drawn alone and in a batch of 300 gets the
    same token, and a row whose only finite logits lie in the middle or at the very end of its vocabulary gets one
    of them."""
    from worker.sampling import noise_keys

    rows = 300
    logits = 4 * torch.randn(rows, vocab, device="cuda")
    middle, end = vocab // 2, vocab - 2
    logits[1, :middle] = logits[1, middle + 3:] = float("-inf")
    logits[2, :end] = float("-inf")
    temperature = torch.rand(rows, device="cuda") + 0.2
    keys = torch.tensor([noise_keys(3, r, 5) for r in range(rows)], dtype=torch.int64, device="cuda")
    batch = kernels.gumbel_argmax(logits, temperature, keys)
    alone = torch.cat([kernels.gumbel_argmax(logits[r : r + 1], temperature[r : r + 1], keys[r : r + 1])
                       for r in range(8)])
    assert torch.equal(alone, batch[:8])
    assert torch.equal(kernels.gumbel_argmax(logits, temperature, keys, parts=1), batch)  # one program a row
    assert middle <= int(batch[1]) < middle + 3 and int(batch[2]) >= end


@pytest.mark.parametrize(("rows", "width", "vocab"), [(128, 128256, 128256), (33, 4100, 4097), (3, 7, 5)])
def test_penalties_kernel_gives_the_references_logits(rows, width, vocab):
    """Rows of nine sequences' counts and prompts, rows without penalties (-1) left alone, columns past the
    counts' vocabulary left alone, -inf logits (a grammar's mask) kept -inf."""
    seqs = 9
    logits = 4 * torch.randn(rows, width, device="cuda")
    logits[0, :3] = float("-inf")
    counts = torch.randint(0, 3, (seqs, vocab), dtype=torch.int32, device="cuda")
    prompt = torch.rand(seqs, vocab, device="cuda") < 0.1
    at = torch.randint(-1, seqs, (rows,), device="cuda")
    at[0] = 4
    penalties = torch.stack([torch.rand(rows) + 0.5, 4 * torch.rand(rows) - 2, 4 * torch.rand(rows) - 2], 1).cuda()
    got = kernels.penalize(logits, at, penalties, counts, prompt)
    want = kernels.penalize_reference(logits, at, penalties, counts, prompt)
    assert torch.equal(got.isneginf(), want.isneginf()) and bool(got[0, :3].isneginf().all())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    untouched = at < 0
    assert torch.equal(got[untouched], logits[untouched]) and torch.equal(got[:, vocab:], logits[:, vocab:])
