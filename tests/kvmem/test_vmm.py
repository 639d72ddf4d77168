"""The VMM backends themselves: reservation, physical pages, mapping, sharing, zero pages, errors."""

from __future__ import annotations

import pytest
import torch

from kvmem import KVCacheSpec, VMMError
from tests.conftest import make_vmm


@pytest.fixture
def vmm(backend):
    v = make_vmm(backend)
    yield v
    v.close()


def test_one_physical_page_mapped_twice_is_one_memory(vmm):
    page = vmm.granularity
    va = vmm.reserve(4 * page)
    handle = vmm.create(page)
    vmm.map(va, page, handle)
    vmm.map(va + 2 * page, page, handle)
    view = vmm.tensor(va, 4 * page)
    view[:page] = 7
    assert int(view[2 * page + 123]) == 7
    view[2 * page + 5] = 9
    assert int(view[5]) == 9
    vmm.unmap(va, page)
    vmm.unmap(va + 2 * page, page)
    vmm.release(handle)
    vmm.free(va, 4 * page)


def test_zero_page_reads_zero_and_page_survives_remap(vmm):
    page = vmm.granularity
    va = vmm.reserve(2 * page)
    vmm.map_zero(va, page)
    vmm.map_zero(va + page, page)
    view = vmm.tensor(va, 2 * page)
    assert int(view.sum()) == 0
    handle = vmm.create(page)
    vmm.unmap(va + page, page)
    vmm.map(va + page, page, handle)
    view[page:] = 3
    vmm.unmap(va + page, page)
    vmm.map_zero(va + page, page)
    assert int(view[page:].sum()) == 0
    vmm.unmap(va + page, page)
    vmm.map(va + page, page, handle)  # the physical page kept its data while unmapped
    assert int(view[page:].float().mean()) == 3
    for offset in (0, page):
        vmm.unmap(va + offset, page)
    vmm.release(handle)
    vmm.free(va, 2 * page)


def test_failed_call_names_the_call(vmm):
    page = vmm.granularity
    va = vmm.reserve(2 * page)
    handle = vmm.create(page)
    with pytest.raises(VMMError, match=r"(mmap|cuMemMap)\("):
        vmm.map(va + 1, page, handle)  # misaligned
    vmm.release(handle)
    vmm.free(va, 2 * page)


def test_bfloat16_views_work(vmm):
    page = vmm.granularity
    va = vmm.reserve(page)
    handle = vmm.create(page)
    vmm.map(va, page, handle)
    view = vmm.tensor(va, page).view(torch.bfloat16)
    view.fill_(1.5)
    assert float(view.float().mean()) == 1.5
    vmm.unmap(va, page)
    vmm.release(handle)
    vmm.free(va, page)


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        KVCacheSpec(0, 2, 4)
    with pytest.raises(ValueError, match="layout must be one of"):
        KVCacheSpec(2, 2, 4, layout="ring")
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        KVCacheSpec(2, 2, 4, page_size=3 << 20)


def test_slot_rows_round_up_to_whole_pages():
    # Yi-34B at TP 2 in the mega layout: 60 layers x 4 heads x 128 x 2 bytes = 60 KiB per token.
    spec = KVCacheSpec(60, 4, 128, torch.bfloat16, max_slots=2, max_tokens=1000, layout="mega", page_size=2 << 20)
    assert spec.token_bytes == 60 * 4 * 128 * 2
    assert spec.slot_tokens % 512 == 0 and spec.slot_tokens >= 1000
    assert spec.slot_bytes % spec.page_size == 0
    assert (spec.pages_for(34), spec.pages_for(35)) == (1, 2)  # token 35 straddles the 2 MiB boundary


def test_a_run_of_pages_mapped_at_once_is_each_its_own_mapping(vmm):
    """``map_run``: CUDA sets the access of the whole run in one call; each page still unmaps alone, a run that
    cannot be mapped leaves nothing mapped, and one ``unmap`` takes several adjacent mappings."""
    page = vmm.granularity
    va = vmm.reserve(4 * page)
    handles = [vmm.create(page) for _ in range(3)]
    vmm.map_run(va, page, handles)
    view = vmm.tensor(va, 3 * page)
    for i in range(3):
        view[i * page : (i + 1) * page] = i + 1
    vmm.unmap(va + page, page)  # the middle one alone
    vmm.map(va + page, page, handles[1])
    assert [int(view[i * page + 7]) for i in range(3)] == [1, 2, 3]
    for i in range(3):
        vmm.unmap(va + i * page, page)
    with pytest.raises(VMMError, match=r"(mmap|cuMemMap)\("):
        vmm.map_run(va + 1, page, handles[:2])  # misaligned
    vmm.map_run(va, page, handles)  # the failed run left the range unmapped
    vmm.unmap(va, 3 * page)  # adjacent mappings go in one call
    vmm.map_run(va + page, page, handles[::-1])
    for i in range(1, 4):
        vmm.unmap(va + i * page, page)
    for h in handles:
        vmm.release(h)
    vmm.free(va, 4 * page)
