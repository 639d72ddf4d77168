"""Shared factories. Every kvmem test runs on HostVMM; the ``cuda`` variants (``pytest -m gpu``) run the
same test on CudaVMM and are skipped, with the reason, where no CUDA device is present."""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter

import pytest
import torch

from kvmem import HostVMM, KVCacheSpec, VirtualKVCache

BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]

_SESSION = pytest.StashKey[pytest.Session]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process here, every result reported, without the interpreter's teardown: Ray 2.60 leaves its GCS
    client's gRPC threads running after ``ray.shutdown()`` (seen: ``gcs_client_io_s``, ``event_engine``,
    ``grpc_global_tim``), and CI printed "615 passed" and then died of SIGSEGV, twice, after Python's own teardown
    (``PYTHONFAULTHANDLER`` printed nothing): where the C++ static destructors run beside those threads. A thread of
    ours still running would have kept the interpreter from exiting: it fails the run instead, by name."""
    session = config.stash.get(_SESSION, None)
    if session is None:  # pytest stopped before the session began (a usage error): its own exit stands
        return
    status = int(session.exitstatus)
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if left:
        print(f"threads still running after the tests: {', '.join(left)}", file=sys.stderr)
        status = status or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def cuda_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "cuda-bindings not installed"
    return None


def needs_attention(name: str) -> None:
    """Skip, saying why, where the GPU or the attention backend's packages are missing."""
    if cuda_missing():
        pytest.skip(cuda_missing())
    if name.startswith("flash"):
        pytest.importorskip("flash_attn")  # every flash* backend decodes on flash-attn
    if name.startswith("flashinfer"):
        pytest.importorskip("flashinfer")
    if name == "fa3":
        pytest.importorskip("flash_attn_interface")  # tools/build_fa3.py


def make_vmm(backend: str):
    if backend == "host":
        return HostVMM()
    reason = cuda_missing()
    if reason:
        pytest.skip(reason)
    from kvmem.vmm.cuda import CudaVMM

    return CudaVMM(0)


def make_spec(backend: str, layout: str = "mega", *, max_slots: int = 4, pages_per_slot: int = 4) -> KVCacheSpec:
    """A small spec whose page holds a few hundred tokens or fewer on either backend."""
    heads, dim, page = (2, 16, 4096) if backend == "host" else (8, 128, 2 << 20)
    probe = KVCacheSpec(2, heads, dim, torch.float32, 1, 1, layout, page)
    tokens_per_page = page // probe.token_bytes
    return KVCacheSpec(2, heads, dim, torch.float32, max_slots, pages_per_slot * tokens_per_page, layout, page)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param == "cuda" and cuda_missing():
        pytest.skip(cuda_missing())
    return request.param


@pytest.fixture
def cache_factory(backend):
    """``cache_factory(layout="mega", pool_groups=16, zero_unmapped=True, background_unmaps=False, **spec_kwargs)`` ->
    VirtualKVCache, closed after the test."""
    made = []

    def factory(layout: str = "mega", pool_groups: int = 16, zero_unmapped: bool = True, background_unmaps: bool = False,
                **spec_kwargs):
        spec = make_spec(backend, layout, **spec_kwargs)
        cache = VirtualKVCache(spec, pool_groups * spec.num_buffers * spec.page_size, make_vmm(backend),
                               zero_unmapped=zero_unmapped, background_unmaps=background_unmaps)
        made.append(cache)
        return cache

    yield factory
    for cache in made:
        cache.close()
        cache._vmm.close()


def tokens_per_page(cache) -> int:
    return cache.spec.page_size // cache.spec.token_bytes


def check_invariants(cache) -> None:
    """Every used token is backed; no page owned twice unless shared (and then counted); free + mapped = pool.
    A page the prefix cache holds counts one reference more."""
    refs = Counter(page for state in cache._slots for page in state.pages)
    refs.update(cache._kept.values())
    assert refs == Counter(cache._refs), "reference counts disagree with the slots' pages"
    assert cache._num_shared == sum(1 for n in refs.values() if n > 1)
    # A fused run maps whole: every slot holds all of it, in order, or none; the prefix cache all of its keys or none.
    for state in cache._slots:
        i = 0
        while i < len(state.pages):
            run = cache._runs.get(state.pages[i])
            assert run is None or tuple(state.pages[i : i + len(run)]) == run, "a slot holds part of a fused run"
            i += len(run) if run else 1
    held = set(cache._kept.values())
    for run in set(cache._runs.values()):
        assert len({page in held for page in run}) == 1, "the prefix cache holds part of a fused run"
    assert not cache._runs_back, "a fused run is half given back"
    for state in cache._slots:
        if state.in_use:
            assert len(state.pages) >= cache.spec.pages_for(state.tokens), "a used token is not backed"
        else:
            assert state.tokens == 0
    if isinstance(cache, VirtualKVCache):
        physical = [p for group in refs for p in group]
        assert len(physical) == len(set(physical)), "a physical page sits in two different groups"
        assert not set(physical) & set(cache._pool._free), "a mapped page is also free"
        assert cache._pool.num_free + len(physical) == cache._pool.num_pages
    else:
        blocks = list(refs)
        assert not set(blocks) & set(cache._free)
        assert len(cache._free) + len(blocks) == cache.num_pages
