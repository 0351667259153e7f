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
from typing import Any

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.slow]

CLI = [sys.executable, "-m", "kvmesh.client.cli"]


def kvmesh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
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
