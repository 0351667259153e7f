"""A worker's side door for peers on its own node: the few small calls a pull makes to its source
(pin a run, unpin it, agree to an NCCL send) over a Unix socket served on the actor's event loop.

A Ray actor call between two idle workers costs ~2-3 ms on a GPU host (measured on an H100 host:
2.6 ms with 10 ms between calls, 0.65 ms for the same request over a Unix socket served by an
asyncio loop through an engine-thread hop), and a same-GPU pull of 7.5K tokens copies in ~1 ms, so
the call was most of a pull. Everything else (the IPC handle, exports, peers on other nodes) stays
on Ray. The puller's engine thread also holds a blocking end of the same channel
(`BlockingChannel`), a second connection, for a same-GPU pin asked and answered within a request's
admission.

Wire format, little-endian; one request at a time per connection, answered in order:

    request   op u8 | arg i32 | n u32 | n x u64 (hashes) or u32 (block ids)
    reply     n i32 (NONE_REPLY: None; ERROR_REPLY: then a u32 length and a UTF-8 message)
              | n x u32 block ids
"""

from __future__ import annotations

import asyncio
import enum
import logging
import select
import socket
import struct
import threading
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TypeVar, cast

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("<BiI")
_COUNT = struct.Struct("<i")
_LENGTH = struct.Struct("<I")
NONE_REPLY = -1
ERROR_REPLY = -2


class ChannelOp(enum.IntEnum):
    PIN = 1
    """arg unused, hashes -> the block ids of the leading run held (pinned)"""
    UNPIN = 2
    """arg unused, block ids -> none"""
    NCCL_ACCEPT = 3
    """arg: the puller's rank, hashes -> block ids being sent, or None (busy)"""


RECEIVE_TIMEOUT_S = 30.0
"""How long a blocking reader waits for a reply it is owed before it gives the channel up."""

T = TypeVar("T")


class ChannelError(RuntimeError):
    """The source answered with an error (its message), or the channel broke."""


Handler = Callable[[Sequence[int], int], Awaitable[list[int] | None]]
"""What the source runs for one op: (hashes or ids, arg) -> block ids, or None."""


def encode_request(op: ChannelOp, values: Sequence[int], arg: int = 0) -> bytes:
    code = "Q" if op is not ChannelOp.UNPIN else "I"
    return _REQUEST.pack(op, arg, len(values)) + struct.pack(f"<{len(values)}{code}", *values)


def encode_reply(ids: Sequence[int] | None) -> bytes:
    if ids is None:
        return _COUNT.pack(NONE_REPLY)
    return _COUNT.pack(len(ids)) + struct.pack(f"<{len(ids)}I", *ids)


def encode_error(message: str) -> bytes:
    data = message.encode()[:4096]
    return _COUNT.pack(ERROR_REPLY) + _LENGTH.pack(len(data)) + data


async def _read_request(reader: asyncio.StreamReader) -> tuple[ChannelOp, int, list[int]]:
    op_code, arg, n = _REQUEST.unpack(await reader.readexactly(_REQUEST.size))
    op = ChannelOp(op_code)
    width, code = (4, "I") if op is ChannelOp.UNPIN else (8, "Q")
    values = list(struct.unpack(f"<{n}{code}", await reader.readexactly(width * n)))
    return op, arg, values


def _reply_parts() -> Generator[int, bytes, list[int] | None]:
    """A reply, parsed as it is read: yields how many bytes it needs next and is sent them;
    returns the block ids (None: NONE_REPLY) or raises the source's error."""
    (n,) = _COUNT.unpack((yield _COUNT.size))
    if n == NONE_REPLY:
        return None
    if n == ERROR_REPLY:
        (length,) = _LENGTH.unpack((yield _LENGTH.size))
        raise ChannelError((yield length).decode(errors="replace"))
    if n < 0:
        raise ChannelError(f"bad reply count {n}")
    return list(struct.unpack(f"<{n}I", (yield 4 * n)))


async def _read_reply(reader: asyncio.StreamReader) -> list[int] | None:
    parts = _reply_parts()
    wanted = next(parts)
    while True:
        try:
            wanted = parts.send(await reader.readexactly(wanted))
        except StopIteration as done:
            return cast("list[int] | None", done.value)


async def serve(path: str, handlers: dict[ChannelOp, Handler]) -> asyncio.AbstractServer:
    """Serve `handlers` on a Unix socket at `path` on the running loop. A handler's exception
    goes back to the caller as its message; a malformed request closes that connection."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    op, arg, values = await _read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the peer hung up
                try:
                    reply = encode_reply(await handlers[op](values, arg))
                except Exception as exc:  # the caller recomputes; this worker serves on
                    reply = encode_error(f"{type(exc).__name__}: {exc}")
                writer.write(reply)
                await writer.drain()
        except (ValueError, struct.error) as exc:
            log.warning("peer channel: dropping a connection that sent a bad request: %s", exc)
        finally:
            writer.close()

    return await asyncio.start_unix_server(connection, path)


class PeerChannel:
    """The puller's end of one peer's channel. Invariant: requests go out and are answered one
    at a time (`_lock`); once broken, every call raises `ChannelError`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self.broken = False

    @classmethod
    async def connect(cls, path: str) -> PeerChannel:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer)

    async def call(self, op: ChannelOp, values: Sequence[int], arg: int = 0) -> list[int] | None:
        async with self._lock:
            if self.broken:
                raise ChannelError("the peer channel is closed")
            try:
                self._writer.write(encode_request(op, values, arg))
                await self._writer.drain()
                return await _read_reply(self._reader)
            except ChannelError:
                raise
            except (OSError, asyncio.IncompleteReadError) as exc:
                self.close()
                raise ChannelError(f"the peer channel broke: {exc!r}") from None

    def close(self) -> None:
        """Safe from any thread (a Ray actor's plain methods may run off its event loop)."""
        self.broken = True
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._writer.close)


class BlockingChannel:
    """The puller's blocking end of one peer's channel, for the engine thread: it sends a pin
    before the request is reserved and reads the answer after, with no event loop between
    (`admission_pull.py`). Invariant: at most one request awaits its reply; whoever holds
    `_busy` owns the socket (`try_take` / `give_back`); once broken, every call raises
    `ChannelError`."""

    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
        except OSError:
            self._sock.close()
            raise
        self._busy = threading.Lock()
        self.broken = False

    def try_take(self) -> bool:
        """Own the channel for one request and its reply; False while another owns it."""
        if self.broken:
            return False
        return self._busy.acquire(blocking=False)

    def give_back(self) -> None:
        self._busy.release()

    def send(self, op: ChannelOp, values: Sequence[int], arg: int = 0) -> None:
        self._io(lambda: self._sock.sendall(encode_request(op, values, arg)))

    def answered_within(self, timeout_s: float) -> bool:
        """Whether the reply has begun to arrive within `timeout_s` (it is read whole after).
        Polled, not `select`ed: a worker process can hold more than 1,024 descriptors."""

        def wait() -> bool:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            return bool(poller.poll(timeout_s * 1e3))

        return self._io(wait)

    def receive(self, timeout_s: float = RECEIVE_TIMEOUT_S) -> list[int] | None:
        """The reply to the request sent; a source silent for `timeout_s` breaks the channel."""
        self._io(lambda: self._sock.settimeout(timeout_s))
        return self._io(self._read_reply)

    def _read_reply(self) -> list[int] | None:
        parts = _reply_parts()
        wanted = next(parts)
        while True:
            try:
                wanted = parts.send(self._read_exactly(wanted))
            except StopIteration as done:
                return cast("list[int] | None", done.value)

    def _read_exactly(self, num_bytes: int) -> bytes:
        data = bytearray()
        while len(data) < num_bytes:
            chunk = self._sock.recv(num_bytes - len(data))
            if not chunk:
                raise ConnectionError("the peer closed its channel")
            data += chunk
        return bytes(data)

    def _io(self, fn: Callable[[], T]) -> T:
        if self.broken:
            raise ChannelError("the peer channel is closed")
        try:
            return fn()
        except (OSError, ValueError) as exc:  # a timeout (a half-read reply is lost), or a
            # socket another thread closed meanwhile (its descriptor gone: ValueError)
            self.close()
            raise ChannelError(f"the peer channel broke: {exc!r}") from None

    def close(self) -> None:
        self.broken = True
        self._sock.close()
