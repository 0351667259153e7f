"""A coordinator's end of one worker's request channel (`workers/request_channel.py`): submit,
abort and the output stream over a Unix socket, for a worker on this coordinator's node.

    Cluster._call --submit / abort--> SideDoor ==socket==> worker's event loop
    OutputReader thread <--batches()-- SideDoor <==socket== the worker's outputs

Blocking sockets: callers are the gRPC threads and one reader thread per worker, as with Ray.
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future

from kvmesh.workers.contract.requests import WorkerRequest
from kvmesh.workers.output_batches import BatchItem
from kvmesh.workers.request_channel import Frame, encode, recv_frame


class SideDoorClosed(ConnectionError):
    """The door broke or was closed before the worker answered."""


class SideDoor:
    """One output stream over one connection.

    Invariants: a frame goes out whole (`_send_lock`); a submit's future is resolved exactly
    once, by its SUBMITTED frame or, once the door ended, with SideDoorClosed; after the end no
    future is pending and every submit fails at once.
    """

    def __init__(self, sock: socket.socket, stream_id: str) -> None:
        self.stream_id = stream_id
        self._sock = sock
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[None]] = {}
        self._seq = itertools.count()
        self._ended = False
        self._send(encode(Frame.OPEN, stream_id))

    @classmethod
    def connect(cls, path: str, stream_id: str, timeout_s: float = 5.0) -> SideDoor:
        """Open `stream_id` on the worker serving `path`. Raises OSError if it cannot."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.settimeout(None)
            return cls(sock, stream_id)
        except BaseException:
            sock.close()
            raise

    @property
    def ended(self) -> bool:
        with self._lock:
            return self._ended

    def submit(self, request: WorkerRequest) -> Future[None]:
        """Send `request`; its future holds None once the worker accepted it, else the
        exception its submit raised (RequestRejected, WorkerFailed), or SideDoorClosed."""
        done: Future[None] = Future()
        with self._lock:
            if self._ended:
                done.set_exception(SideDoorClosed("the side door is closed"))
                return done
            seq = next(self._seq)
            self._pending[seq] = done
        try:
            self._send(encode(Frame.SUBMIT, seq, request))
        except OSError as exc:
            self._fail(seq, SideDoorClosed(f"the side door broke: {exc!r}"))
        return done

    def abort(self, request_id: str) -> bool:
        """Ask the worker to stop `request_id`; False if the door cannot carry it."""
        try:
            self._send(encode(Frame.ABORT, request_id))
        except OSError:
            return False
        return True

    def batches(self) -> Iterator[list[BatchItem]]:
        """The stream's batches, for its one reader, until the door ends (the worker's end, or
        `close`); then every submit still waiting fails with SideDoorClosed. Raises BadFrame
        for a frame that does not decode."""
        try:
            while True:
                try:
                    message = recv_frame(self._sock)
                except OSError:
                    return
                if message is None:
                    return
                if message[0] is Frame.BATCH:
                    yield message[1]
                elif message[0] is Frame.SUBMITTED:
                    self._answer(message[1], message[2])
        finally:
            self._sock.close()
            with self._lock:
                self._ended = True
                pending = list(self._pending)
            for seq in pending:
                self._fail(seq, SideDoorClosed("the side door closed before the worker answered"))

    def close(self) -> None:
        """End the stream (the worker aborts its requests); `batches` returns and lets go of
        the socket. Any thread."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already ended

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            self._sock.sendall(data)

    def _answer(self, seq: int, error: BaseException | None) -> None:
        with self._lock:
            done = self._pending.pop(seq, None)
        if done is None:
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def _fail(self, seq: int, error: SideDoorClosed) -> None:
        with self._lock:
            done = self._pending.pop(seq, None)
        if done is not None:
            done.set_exception(error)
