"""A worker's side doors: the Unix-socket servers through which callers on its own node skip Ray
for the small calls on a request's path, the pull channel for peers (`transfer/peer_channel.py`)
and the request channel for coordinators (`request_channel.py`). Each is served on the actor's
event loop from its first ask on, at a path only this user may open."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Awaitable, Callable


class SideDoors:
    """Invariants: a door's server is started at most once (`_lock`), and its socket file is
    this user's only (0o600) before its path is handed out; `close` ends them all."""

    def __init__(self, worker_id: str) -> None:
        self._worker_id = worker_id
        self._servers: dict[str, tuple[asyncio.AbstractServer, str]] = {}
        self._lock: asyncio.Lock | None = None

    async def open(
        self, name: str, serve: Callable[[str], Awaitable[asyncio.AbstractServer]]
    ) -> str:
        """The path of the door `name`, served by `serve(path)` from the first call on."""
        if self._lock is None:
            self._lock = asyncio.Lock()  # made on the loop that serves the doors
        async with self._lock:
            if name not in self._servers:
                path = os.path.join(
                    tempfile.gettempdir(), f"kvmesh-{os.getpid()}-{self._worker_id}-{name}.sock"
                )
                if os.path.exists(path):
                    os.unlink(path)  # left by a process that had this pid before
                server = await serve(path)
                os.chmod(path, 0o600)  # this user's processes only: pins and requests
                self._servers[name] = (server, path)
            return self._servers[name][1]

    def close(self) -> None:
        """Stop serving and remove the socket files; safe from any thread."""
        for server, path in self._servers.values():
            server.get_loop().call_soon_threadsafe(server.close)
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._servers.clear()
