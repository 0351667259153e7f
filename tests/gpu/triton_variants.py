"""How many variants of a Triton kernel have been compiled in this process (the kernels that run
on a request's path must compile once, when the worker is built, not per block count)."""

from __future__ import annotations

from typing import Any


def compiled_variants(kernel: Any) -> int | None:
    """Compiled variants of `kernel` on every device; None if this Triton keeps them elsewhere."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return None
    return sum(len(entry[0]) for entry in caches.values())
