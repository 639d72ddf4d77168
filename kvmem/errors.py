"""Errors raised by kvmem. Bad arguments raise ``ValueError``; these are for state and system failures."""


class KVCacheError(RuntimeError):
    """The cache cannot do what was asked (virtual space, slots, backend failure)."""


class KVCacheExhausted(KVCacheError):
    """The physical page pool cannot back a request; the cache state is unchanged."""

    def __init__(self, needed_pages: int, free_pages: int, what: str = ""):
        self.needed_pages = needed_pages
        self.free_pages = free_pages
        detail = f" for {what}" if what else ""
        super().__init__(
            f"KV cache exhausted{detail}: needs {needed_pages} physical pages, "
            f"{free_pages} free or reclaimable"
        )


class VMMError(KVCacheError):
    """A virtual-memory call of a backend failed; the message names the call and its arguments."""
