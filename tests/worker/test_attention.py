"""Attention backends agree with each other over the same cache contents.

CPU: the reference path over virtual rows and over paged block rows gives the same result.
GPU (-m gpu): FlashAttention-2 read in place from the virtual cache (torch's built-in ``fa2`` and, where
the package is installed, flash-attn's ``flash_attn_with_kvcache``), and the paged gather + FA2 path,
agree with the reference for prefill, chunked prefill (mixed with a decode) and decode, in the mega and
per_layer layouts.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvmem import KVCacheSpec, PagedKVCache, VirtualKVCache, paged_spec
from tests.conftest import cuda_missing, make_vmm, needs_attention
from worker.attention import AttentionMetadata, SeqAttention, get_backend, reference

LAYERS, HEADS, KV_HEADS, DIM = 2, 8, 2, 64


def fill(cache, seqs: list[SeqAttention], gen: torch.Generator, layers=range(LAYERS)) -> None:
    for s in seqs:
        for layer in layers:
            shape, like = (s.kv_len, KV_HEADS, cache.spec.head_dim), cache.rows(layer)[0]
            k = torch.randn(shape, generator=gen).to(like)
            cache.write(layer, s.slot, 0, k, torch.randn(shape, generator=gen).to(like))


def cases(max_tokens: int) -> dict[str, list[tuple[int, int]]]:
    """(query_len, kv_len) per sequence."""
    return {
        "prefill": [(n, n) for n in (37, 300, 5, 129)],
        "chunked": [(64, 400), (17, 17), (100, 1000), (1, 77)],
        "decode": [(1, n) for n in (1, 513, max_tokens, 90)],
    }


def run(cache, backend: str, seqs, q, device, layer: int = 1) -> torch.Tensor:
    impl = get_backend(backend, device)
    meta = AttentionMetadata.build(seqs, cache, torch.device(device), impl.reads)
    k_rows, v_rows = cache.rows(layer)
    return impl.forward(q, k_rows, v_rows, meta).float()


def setup(cache_kind: str, layout: str, device: str, case: list[tuple[int, int]], block_size: int = 16, dim: int = DIM):
    max_tokens = 1024
    if cache_kind == "paged":
        spec = paged_spec(LAYERS, KV_HEADS, dim, block_size, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                          max_slots=8, max_tokens=max_tokens)
        cache = PagedKVCache(spec, 8 * max_tokens * spec.bytes_per_token, device)
    else:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        page = 2 << 20 if device == "cuda" else 64 << 10
        spec = KVCacheSpec(LAYERS, KV_HEADS, dim, dtype, 8, max_tokens, layout, page)
        cache = VirtualKVCache(spec, 8 * spec.physical_bytes_for(max_tokens), make_vmm("cuda" if device == "cuda" else "host"))
    slots = [cache.alloc_slot() for _ in case]
    order = [slots[i] for i in (2, 0, 3, 1)]  # slots out of order: starts are not monotonic
    seqs = [SeqAttention(slot, q, k) for slot, (q, k) in zip(order, case)]
    for s in seqs:
        cache.ensure(s.slot, s.kv_len)
    gen = torch.Generator().manual_seed(0)
    fill(cache, seqs, gen)
    q = torch.randn(sum(s.query_len for s in seqs), HEADS, dim, generator=gen).to(device=device, dtype=spec.dtype)
    return cache, seqs, q


@pytest.mark.parametrize("case", ["prefill", "chunked", "decode"])
def test_reference_over_paged_rows_equals_reference_over_virtual_rows(case):
    lengths = cases(1024)[case]
    virtual, seqs_v, q = setup("virtual", "mega", "cpu", lengths)
    paged, seqs_p, q2 = setup("paged", "", "cpu", lengths)
    assert torch.equal(q, q2)
    assert torch.allclose(run(virtual, "torch", seqs_v, q, "cpu"), run(paged, "paged", seqs_p, q, "cpu"), atol=1e-5)
    virtual.close()


@pytest.mark.parametrize("batch_rows", [1 << 18, 600])  # 600: the decode rows split into several batches
def test_the_references_batched_decode_rows_equal_each_row_computed_alone(monkeypatch, batch_rows):
    """Decode rows go to SDPA in batches over K/V padded to the longest sequence; each row still attends to exactly
    its own sequence's keys (checked in float64, one row at a time), prefill chunks beside them too."""
    monkeypatch.setattr(reference, "DECODE_BATCH_ROWS", batch_rows)
    lengths = [(1, 513), (64, 400), (1, 1), (1, 90)]
    cache, seqs, q = setup("virtual", "mega", "cpu", lengths)
    out = run(cache, "torch", seqs, q, "cpu")
    meta = AttentionMetadata.build(seqs, cache, torch.device("cpu"), "rows")
    k_rows, v_rows = cache.rows(1)
    row = 0
    for (_, seq, k, v) in reference.gathered(k_rows, v_rows, meta):
        for j in range(seq.query_len):
            seen = seq.kv_len - seq.query_len + j + 1
            ks, vs = (t[:, :seen].double().repeat_interleave(HEADS // KV_HEADS, 0) for t in (k, v))
            weights = torch.softmax(q[row + j].double()[:, None, :] @ ks.transpose(1, 2) / DIM ** 0.5, -1)
            assert torch.allclose(out[row + j].double(), (weights @ vs)[:, 0], atol=1e-5)
        row += seq.query_len
    cache.close()


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_in_place_backends_need_cuda():
    for name in ("fa2", "flash_attn", "flash_attn_paged", "flashinfer", "flashinfer_paged", "fa3"):
        with pytest.raises(ValueError, match=f"attention backend '{name}' needs a CUDA device"):
            get_backend(name, "cpu")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_paged"])
def test_flash_attn_backends_say_how_to_get_the_package(name):
    with pytest.raises(ImportError, match="attention backends 'flash_attn' and 'flash_attn_paged' need the flash-attn package"):
        get_backend(name, "cuda")


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
@pytest.mark.parametrize("name", ["flashinfer", "flashinfer_paged"])
def test_flashinfer_backends_say_how_to_get_the_package(name):
    with pytest.raises(ImportError, match="attention backends 'flashinfer' and 'flashinfer_paged' need the flashinfer-python"):
        get_backend(name, "cuda")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn_interface") is not None, reason="FlashAttention-3 is installed")
def test_fa3_backend_says_how_to_get_it():
    with pytest.raises(ImportError, match="attention backend 'fa3' needs FlashAttention-3 .*tools/build_fa3.py"):
        get_backend("fa3", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["prefill", "chunked", "decode"])
@pytest.mark.parametrize(("layout", "backend"), [("mega", "fa2"), ("per_layer", "fa2"), ("paged", "paged"),
                                                 ("mega", "flash_attn"), ("per_layer", "flash_attn"),
                                                 ("paged", "flash_attn_paged"), ("mega", "flashinfer"),
                                                 ("per_layer", "flashinfer"), ("paged", "flashinfer_paged"),
                                                 ("mega", "fa3"), ("per_layer", "fa3")])
def test_fast_backends_agree_with_reference_on_gpu(layout, backend, case):
    needs_attention(backend)
    cache_kind = "paged" if layout == "paged" else "virtual"
    block = 256 if backend in ("flash_attn_paged", "flashinfer_paged") else 16
    # FlashInfer's and FA3's kernels are compiled per head size: 128 is the one the build tools make by default
    dim = 128 if backend.startswith("flashinfer") or backend == "fa3" else DIM
    cache, seqs, q = setup(cache_kind, layout, "cuda", cases(1024)[case], block, dim)
    fast = run(cache, backend, seqs, q, "cuda")
    ref = run(cache, "torch", seqs, q, "cuda")
    assert relerr(fast, ref) < 1e-2
    cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["1", "0"])
def test_fa3_decodes_on_its_decode_tiles_or_on_flash_attn(monkeypatch, tiles):
    """An all-decode step: FA3's own call where tools/build_fa3.py built decode tiles (64-row tiles, one MMA
    warpgroup), flash-attn's split-KV kernel where they are switched off; both agree with the reference."""
    needs_attention("fa3")
    import flash_attn_3

    if not getattr(flash_attn_3, "vattn_decode_tiles", False):
        pytest.skip("this FA3 was built without decode tiles (tools/build_fa3.py --no-decode-tiles)")
    monkeypatch.setenv("VATTN_FA3_DECODE_TILES", tiles)
    assert get_backend("fa3", "cuda").fa3_decodes == (tiles == "1")
    for layout in ("mega", "per_layer"):
        cache, seqs, q = setup("virtual", layout, "cuda", cases(1024)["decode"], 16, 128)
        assert relerr(run(cache, "fa3", seqs, q, "cuda"), run(cache, "torch", seqs, q, "cuda")) < 1e-2
        cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", ["0", "1"])
def test_fa3_decode_layers_share_one_schedule(monkeypatch, splits):
    """An all-decode step works FA3's schedule out once and every layer's call reuses it: each call must leave the
    persistent scheduler's tile counter reset for the next (the split-combining kernel resets it, or the call after
    an unsplit kernel), or a later layer skips tiles. Layers called in turn with one step's metadata, over and over,
    each agree with the reference; with FA3's own split count and with none."""
    needs_attention("fa3")
    monkeypatch.setenv("VATTN_FA3_DECODE_SPLITS", splits)
    import flash_attn_3

    if not getattr(flash_attn_3, "vattn_decode_tiles", False):
        pytest.skip("this FA3 was built without decode tiles (tools/build_fa3.py --no-decode-tiles)")
    cache, seqs, q = setup("virtual", "mega", "cuda", cases(1024)["decode"], 16, 128)  # layers of unlike K/V
    impl = get_backend("fa3", "cuda")
    meta = AttentionMetadata.build(seqs, cache, torch.device("cuda"), impl.reads)
    for layer in (0, 1, 0, 1, 1, 0):
        out = impl.forward(q, *cache.rows(layer), meta).float()
        assert impl._schedule is not None
        assert relerr(out, run(cache, "torch", seqs, q, "cuda", layer)) < 1e-2
    cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn", "flashinfer", "fa3"])
def test_in_place_kernels_read_slots_past_four_billion_elements(backend):
    """A mega cache whose last slots start past 2**32 elements of their buffer (16 GiB of bf16): kernels that
    keep offsets in 32 bits would read the wrong rows. Only the used slots' pages are mapped."""
    needs_attention(backend)
    layers, dim, max_tokens = 16, 128, 1 << 17  # a slot is 2**17 tokens x 16 layers x 2 heads x 128 = 2**29 elements
    spec = KVCacheSpec(layers, KV_HEADS, dim, torch.bfloat16, 12, max_tokens, "mega", 2 << 20)
    cache = VirtualKVCache(spec, 4 * spec.physical_bytes_for(1024), make_vmm("cuda"))
    seqs = [SeqAttention(cache.alloc_slot(slot=11), 300, 700), SeqAttention(cache.alloc_slot(slot=10), 1, 1000)]
    assert seqs[0].slot * spec.slot_tokens * layers * KV_HEADS * dim > 1 << 32
    for s in seqs:
        cache.ensure(s.slot, s.kv_len)
    gen = torch.Generator().manual_seed(0)
    fill(cache, seqs, gen, layers=[layers - 1])
    q = torch.randn(sum(s.query_len for s in seqs), HEADS, dim, generator=gen).to(device="cuda", dtype=spec.dtype)
    fast = run(cache, backend, seqs, q, "cuda", layers - 1)
    assert relerr(fast, run(cache, "torch", seqs, q, "cuda", layers - 1)) < 1e-2
    cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (28, 4)])
def test_triton_split_kv_decode_agrees_with_float32_reference(heads, kv_heads):
    """``worker/attention/triton_decode.py`` over a strided (mega) layer view: lengths of one token, of a split's
    edge and past several splits, slots out of order."""
    if cuda_missing():
        pytest.skip(cuda_missing())
    from worker.attention.triton_decode import decode_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    slots_, tokens, dim = 6, 1536, 128
    k_all, v_all = (torch.randn(slots_, tokens, 3, kv_heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
    k, v = k_all[:, :, 1], v_all[:, :, 1]
    lengths = [1, 255, 256, 257, 1000, 1536]
    slots = [5, 0, 3, 1, 4, 2]
    q = torch.randn(len(lengths), heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = decode_attention(q, k, v, torch.tensor(lengths, dtype=torch.int32, device="cuda"),
                           torch.tensor(slots, dtype=torch.int32, device="cuda"), split=256)
    for i, (n, s) in enumerate(zip(lengths, slots)):
        keys = k[s, :n].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        values = v[s, :n].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        ref = (((q[i].float()[:, None] @ keys.transpose(1, 2)) / dim**0.5).softmax(-1) @ values)[:, 0]
        assert relerr(out[i].float(), ref) < 1e-2, (n, s)
