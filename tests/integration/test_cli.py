"""The `kvmesh` command line against a real cluster: `up` in the foreground, read commands."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.slow]

CLI = [sys.executable, "-m", "kvmesh.client.cli"]


def kvmesh(
    *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvmesh {' '.join(args)} failed: {proc.stderr}")
    return proc


def _http_get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def test_up_serves_the_read_commands_and_cleans_up_on_sigterm() -> None:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    up = subprocess.Popen(
        [*CLI, "up", "--workers", "2", "--port", "0", "--num-blocks", "96", "--http-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert up.stdout is not None
        address = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not address:
            line = up.stdout.readline()
            if not line:
                break
            m = re.search(r"kvmesh is up at (\S+)", line)
            address = m.group(1) if m else ""
        assert address, "kvmesh up never printed its address"
        m = re.search(r"kvmesh OpenAI API at (\S+)", up.stdout.readline())
        assert m, "kvmesh up --http-port never printed the HTTP API's URL"
        api = m.group(1)
        assert _http_get(api + "/models")["data"][0]["id"] == "tiny-random"

        prefix = ",".join(str(3 + i % 200) for i in range(64))
        first = json.loads(
            kvmesh(
                "generate",
                "--address",
                address,
                "--tokens",
                prefix + ",7",
                "--max-tokens",
                "3",
                "--json",
            ).stdout
        )
        assert set(first) >= {
            "tokens",
            "worker_id",
            "cached_tokens",
            "computed_tokens",
            "ttft_ms",
            "total_ms",
        }
        assert len(first["tokens"]) <= 3 and first["computed_tokens"] == 65
        time.sleep(0.3)
        second = json.loads(
            kvmesh("generate", "--address", address, "--tokens", prefix + ",8", "--json").stdout
        )
        assert second["worker_id"] == first["worker_id"] and second["cached_tokens"] == 64

        stats = json.loads(kvmesh("stats", "--address", address, "--json").stdout)
        assert stats["num_live_workers"] == 2 and stats["cached_tokens"] == 64
        workers = json.loads(kvmesh("workers", "--address", address, "--json").stdout)
        assert {w["worker_id"] for w in workers} == {"w0", "w1"}
        for w in workers:
            assert {"pid", "node", "device", "num_blocks", "num_free_blocks", "alive"} <= set(w)
            assert w["alive"] and w["num_blocks"] == 96

        text = kvmesh(
            "generate", "--address", address, "--prompt", "hello", "--max-tokens", "2", "--json"
        )
        assert json.loads(text.stdout)["prompt_tokens"] == 6

        bad = kvmesh("generate", "--address", address, "--tokens", "1,999999", check=False)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
        assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
        unknown = kvmesh(
            "generate", "--address", address, "--tokens", "1,2", "--worker", "w9", check=False
        )
        assert unknown.returncode == 1 and "unknown worker" in unknown.stderr

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        with pytest.raises(OSError):
            _http_get(api + "/models")
        gone = kvmesh("stats", "--address", address, check=False)
        assert gone.returncode != 0 and "Traceback" not in gone.stderr
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def start_up(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], str]:
    up = subprocess.Popen(
        [*CLI, "up", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert up.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        m = re.search(r"kvmesh is up at (\S+)", line)
        if m:
            return up, m.group(1)
    os.killpg(up.pid, signal.SIGKILL)
    raise AssertionError("kvmesh up never printed its address")


def test_up_keeps_the_tokens_out_of_every_ray_process() -> None:
    admin, user = "admin-secret-4b1e7d", "user-secret-90aa3c"
    env = dict(
        os.environ, RAY_AUTH_MODE="disabled", KVMESH_ADMIN_TOKEN=admin, KVMESH_AUTH_TOKEN=user
    )
    up, address = start_up(env, "--workers", "1", "--num-blocks", "64")
    try:
        reader = dict(env, KVMESH_TOKEN=user)
        workers = json.loads(kvmesh("workers", "--address", address, "--json", env=reader).stdout)
        assert len(workers) == 1
        # The worker, and every process in its ancestry up to `kvmesh up` (raylet, ...).
        pid, seen = int(workers[0]["pid"]), []
        while pid not in (up.pid, 0, 1):
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert admin.encode() not in environ and user.encode() not in environ, pid
            seen.append(pid)
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert seen and pid == up.pid  # the walk reached `kvmesh up` itself
        assert admin.encode() in Path(f"/proc/{up.pid}/environ").read_bytes()  # it kept them
        denied = kvmesh("stats", "--address", address, check=False)
        assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr  # auth is on
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")
def test_a_hard_killed_up_leaves_no_redis_or_ray_process_behind() -> None:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    up = subprocess.Popen(
        [*CLI, "up", "--workers", "1", "--port", "0", "--num-blocks", "64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert up.stdout is not None
    line = up.stdout.readline()
    assert "kvmesh is up" in line, line
    started = _children(up.pid)
    names = {Path(f"/proc/{p}/comm").read_text().strip() for p in started if _alive(p)}
    assert any("redis" in n for n in names), names  # the embedded Redis is among them
    up.send_signal(signal.SIGKILL)
    up.wait(timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(p) for p in started):
        time.sleep(0.5)
    left = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in started if _alive(p)}
    assert not left, f"still running after kvmesh up was killed: {left}"
