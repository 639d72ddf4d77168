"""kvmem: the virtual-memory KV cache (vAttention) and its PagedAttention baseline.

Knows bytes, pages, slots and tensors; knows no model and no Ray.
"""

from kvmem.cache import VirtualKVCache
from kvmem.errors import KVCacheError, KVCacheExhausted, VMMError
from kvmem.mapper import AsyncMapper, MappingPlan
from kvmem.paged import PagedKVCache, paged_spec
from kvmem.spec import KVCacheSpec
from kvmem.stats import KVCacheStats
from kvmem.vmm import VMM, HostVMM, default_vmm

__all__ = [
    "AsyncMapper",
    "HostVMM",
    "KVCacheError",
    "KVCacheExhausted",
    "KVCacheSpec",
    "KVCacheStats",
    "MappingPlan",
    "PagedKVCache",
    "VMM",
    "VMMError",
    "VirtualKVCache",
    "default_vmm",
    "paged_spec",
]
