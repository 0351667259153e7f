"""A worker's side door for a coordinator on its own node: the request path (submit, abort, the
output stream) over a Unix socket served on the actor's event loop, instead of Ray.

A Ray actor call between idle processes costs 1.7-2.7 ms on a GPU host, the same request over a
Unix socket served by an asyncio loop ~0.65 ms (docs/data/actor_call_rtt_h100.json), and a local
hit's request crosses twice (its submit, its output). Coordinators on other nodes, and any door
that fails to open, stay on Ray (`coordinator/cluster/side_door.py` is the other end).

One connection is one output stream (`WorkerRequest.reply_to`), named by its first frame; every
request submitted on it replies to it. Frames are a u32 little-endian length, then a pickle of a
tuple whose first element is a `Frame`. Pickle is what Ray itself sends these objects as; the
socket is its owner's only (0o600).

    coordinator -> worker   (OPEN, stream_id)               first, once
                            (SUBMIT, seq, WorkerRequest)    answered by SUBMITTED, same seq
                            (ABORT, request_id)
    worker -> coordinator   (BATCH, [(request_id, RequestOutput | Exception), ...])
                                                            the first one empty: the stream is open
                            (SUBMITTED, seq, None | the exception submit raised)

The connection's end ends the stream: the worker aborts the requests still routed to it, as when
a Ray reader goes away; the coordinator reads the socket's end as its worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import pickle
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from kvmesh.workers.contract.requests import WorkerRequest
from kvmesh.workers.output_batches import BatchItem

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 256 << 20
"""A frame longer than this is taken for garbage: the connection is dropped."""


class Frame(enum.IntEnum):
    OPEN = 1
    SUBMIT = 2
    ABORT = 3
    BATCH = 4
    SUBMITTED = 5


_FRAME_CODES = frozenset(int(f) for f in Frame)


class BadFrame(ValueError):
    """A frame that does not decode to a known message."""


def encode(frame: Frame, *values: Any) -> bytes:
    """One frame on the wire. Raises if a value does not pickle."""
    data = pickle.dumps((int(frame), *values), protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LENGTH.pack(len(data)) + data


def decode(data: bytes) -> tuple[Any, ...]:
    """A frame's message: (Frame, values...). Raises BadFrame for anything else."""
    try:
        message = pickle.loads(data)
    except Exception as exc:
        raise BadFrame(f"frame of {len(data)} bytes does not unpickle: {exc!r}") from None
    if not isinstance(message, tuple) or not message or message[0] not in _FRAME_CODES:
        raise BadFrame(f"frame is not a (Frame, ...) tuple: {type(message).__name__}")
    return (Frame(message[0]), *message[1:])


def _frame_length(header: bytes) -> int:
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise BadFrame(f"frame length {length} exceeds {MAX_FRAME_BYTES}")
    return int(length)


async def read_frame(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    """The next message; IncompleteReadError at the peer's end."""
    length = _frame_length(await reader.readexactly(_LENGTH.size))
    return decode(await reader.readexactly(length))


def recv_frame(sock: socket.socket) -> tuple[Any, ...] | None:
    """The next message from a blocking socket; None at the peer's end."""
    header = _recv_exactly(sock, _LENGTH.size)
    if header is None:
        return None
    data = _recv_exactly(sock, _frame_length(header))
    if data is None:
        return None
    return decode(data)


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytes | None:
    view = memoryview(bytearray(num_bytes))
    got = 0
    while got < num_bytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return view.tobytes()


def picklable(exc: BaseException) -> BaseException:
    """`exc`, or a RuntimeError with its text when it does not pickle (nor unpickle)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


@dataclass(frozen=True, slots=True)
class RequestHandlers:
    """What the worker runs for a connection: the actor's own `submit`, `abort` and `outputs`."""

    submit: Callable[[WorkerRequest], Awaitable[None]]
    abort: Callable[[str], None]
    outputs: Callable[[str], AsyncIterator[list[BatchItem]]]


async def serve(path: str, handlers: RequestHandlers) -> asyncio.AbstractServer:
    """Serve coordinators' request channels on a Unix socket at `path` on the running loop."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _Connection(reader, writer, handlers).run()

    return await asyncio.start_unix_server(connection, path)


class _Connection:
    """One coordinator's stream. Invariants: a frame goes out whole (`_send_lock`); when the
    connection ends, so does its output stream (its requests aborted) and every submit's reply."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handlers: RequestHandlers
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handlers = handlers
        self._send_lock = asyncio.Lock()
        self._submits: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        stream: AsyncIterator[list[BatchItem]] | None = None
        pump: asyncio.Task[None] | None = None
        try:
            opening = await read_frame(self._reader)
            if opening[0] is not Frame.OPEN or not isinstance(opening[1], str):
                raise BadFrame(f"the first frame must be OPEN with a stream id, got {opening[0]!r}")
            stream_id = opening[1]
            stream = self._handlers.outputs(stream_id)
            pump = asyncio.create_task(self._pump(stream))
            while True:
                self._dispatch(await read_frame(self._reader), stream_id)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the coordinator hung up (or the pump closed the connection)
        except BadFrame as exc:
            log.warning("request channel: dropping a connection that sent a bad frame: %s", exc)
        finally:
            await self._end(stream, pump)

    def _dispatch(self, message: tuple[Any, ...], stream_id: str) -> None:
        kind = message[0]
        if kind is Frame.SUBMIT and len(message) == 3 and isinstance(message[2], WorkerRequest):
            task = asyncio.create_task(self._submit(message[1], message[2], stream_id))
            self._submits.add(task)
            task.add_done_callback(self._submits.discard)
        elif kind is Frame.ABORT and len(message) == 2 and isinstance(message[1], str):
            self._handlers.abort(message[1])
        else:
            raise BadFrame(f"unexpected {kind!r} frame of {len(message)} fields")

    async def _submit(self, seq: int, request: WorkerRequest, stream_id: str) -> None:
        error: BaseException | None = None
        try:
            await self._handlers.submit(replace(request, reply_to=stream_id))
        except Exception as exc:  # the coordinator raises it to its caller
            error = picklable(exc)
        with contextlib.suppress(Exception):  # the connection ended first: nobody to tell
            await self._send(encode(Frame.SUBMITTED, seq, error))

    async def _pump(self, stream: AsyncIterator[list[BatchItem]]) -> None:
        try:
            async for batch in stream:
                try:
                    data = encode(Frame.BATCH, batch)
                except Exception:  # an exception in it that does not pickle: send its text
                    items = [(r, picklable(x) if isinstance(x, Exception) else x) for r, x in batch]
                    data = encode(Frame.BATCH, items)
                await self._send(data)
        except ConnectionError:
            pass
        except Exception:
            log.exception("request channel: the output stream failed; closing the connection")
        finally:
            self._writer.close()  # ends `run` too: its read sees the end

    async def _send(self, data: bytes) -> None:
        async with self._send_lock:
            self._writer.write(data)
            await self._writer.drain()

    async def _end(
        self, stream: AsyncIterator[list[BatchItem]] | None, pump: asyncio.Task[None] | None
    ) -> None:
        # Submits under way run on: one the stream's close missed is rejected (no stream).
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()  # the actor's `outputs` aborts the stream's requests
        self._writer.close()
