"""A watch for `kvmesh up`'s death: whatever it started (Redis, Ray's head processes and their
agents, worker processes) is stopped when it dies, however it dies.

`start_reaper()` starts this module as a separate process holding the read end of a pipe whose
write end only `kvmesh up` holds. While `kvmesh up` lives, the reaper notes its descendants every
half second; when the pipe reports end-of-file (the parent is gone, SIGKILL included), it sends
SIGTERM to every process it noted, then SIGKILL to the ones still there. Descendants must be
noted beforehand: once their parent is dead they are re-parented and no longer findable by
ancestry. Linux (/proc) only; elsewhere `start_reaper()` does nothing.

    python -m kvmesh.coordinator.cluster.reaper PARENT_PID    (stdin: the pipe)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

_POLL_S = 0.5
_GRACE_S = 3.0


def start_reaper() -> subprocess.Popen[bytes] | None:
    """Start the watch over this process; keep the returned handle (its pipe) alive."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh.coordinator.cluster.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,  # not in our process group: a Ctrl-C must not stop it first
        close_fds=True,
    )


def descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int(
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            )
        except (OSError, IndexError, ValueError):
            continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _signal_all(pids: set[int], sig: int) -> set[int]:
    """Send `sig` to each of `pids`; returns those that still existed."""
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, sig)
            alive.add(pid)
        except ProcessLookupError:
            continue
        except PermissionError:
            continue
    return alive


def watch(parent: int) -> None:
    noted: set[int] = set()
    me = os.getpid()
    while True:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], _POLL_S)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            break  # end-of-file: the parent is gone
        noted |= descendants(parent) - {me}
    noted |= {p for p in noted for p in descendants(p)}
    alive = _signal_all(noted, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {p for p in alive if Path(f"/proc/{p}").exists()}
    _signal_all(alive, signal.SIGKILL)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
