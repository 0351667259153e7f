"""Who may touch a worker's state (its pool, scheduler and pulls) right now.

The engine thread holds the lock for each whole iteration of its loop and lets go of it only
while a step's forward pass runs (`Worker.step` calls `released`) and while it waits for room in
the event sender (`event_sender.py`, which takes the step's KV events to Redis). The forward
pass is the long part of a step (a cold 8K prefill on a GPU, ~200 ms), and it reads no pool
state but the block tables it was scheduled with. A same-GPU peer's small calls on a pull's
path (pin a run, unpin it) take the lock themselves, from the worker's event loop, instead of
queueing behind the step for the engine thread (an NCCL send is queued there with its pin: NCCL
calls stay on one thread):

    engine:  [ schedule | forward (released) ............ | outputs, register ] [ next ...
    peer:                   pin ^ runs here, not after the step

A pinned run is always whole: blocks are registered only after the step that wrote them has
synchronised, and a step's own new blocks are not registered yet while its forward runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class StateLock:
    """Invariant: at most one thread touches the worker's state at a time: the holder of
    `_lock`; `released` is only entered by the thread that holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> StateLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @contextmanager
    def released(self) -> Iterator[None]:
        """Let other threads in for the duration (the holder's long work that touches none of
        the state); held again on the way out, whatever happened inside."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def try_run(self, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """Run `fn` under the lock if it is free now: (True, its result); else (False, None)
        without waiting."""
        if not self._lock.acquire(blocking=False):
            return False, None
        try:
            return True, fn()
        finally:
            self._lock.release()

    def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` under the lock, waiting for it."""
        with self:
            return fn()
