"""The coordinator addresses a client may use, and which one it uses now (failover order)."""

from __future__ import annotations

import threading


class AddressRing:
    """Invariant: `addresses` is non-empty and `0 <= index < len(addresses)`."""

    def __init__(self, addresses: list[str]) -> None:
        if not addresses or not all(addresses):
            raise ValueError(f"need at least one non-empty address, got {addresses!r}")
        self.addresses = list(addresses)
        self.index = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return self.addresses[self.index]

    def advance(self) -> str:
        """Move to the next address (wrapping); returns it."""
        with self._lock:
            self.index = (self.index + 1) % len(self.addresses)
            return self.addresses[self.index]
