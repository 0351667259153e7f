"""`kvmesh up --metrics-port P --log-json` as an operator runs it: the endpoint answers with moved
counters, and every line the process writes on stderr is a JSON document, even when a worker
process is killed (Ray's own reports of the death stay out of our output)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.slow]

CLI = [sys.executable, "-m", "kvmesh.client.cli"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def cli_json(env: dict[str, str], command: str, address: str) -> list[dict[str, object]]:
    proc = subprocess.run(
        [*CLI, command, "--address", address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout))


def test_up_serves_metrics_and_writes_only_json_lines() -> None:
    # RAY_ADDRESS=local: a private Ray, never a cluster someone else started on this machine.
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ADDRESS="local")
    metrics_port = free_port()
    up = subprocess.Popen(
        [*CLI, "up", "--workers", "2", "--num-blocks", "64", "--port", "0"]
        + ["--metrics-port", str(metrics_port), "--log-json", "--log-level", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert up.stdout is not None and up.stderr is not None
        address, deadline = "", time.monotonic() + 180
        while time.monotonic() < deadline and not address:
            line = up.stdout.readline()
            if not line:
                break
            m = re.search(r"kvmesh is up at (\S+) .*metrics at http://(\S+)/metrics", line)
            address = m.group(1) if m else ""
        assert address, "kvmesh up never printed its address and metrics endpoint"
        generated = subprocess.run(
            [*CLI, "generate", "--address", address, "--tokens", "5,6,7,8", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert generated.returncode == 0, generated.stderr
        request_id = json.loads(generated.stdout)["request_id"]
        series = scrape(metrics_port)
        assert series[("kvmesh_requests_total", frozenset({("outcome", "ok")}))] == 1
        assert series[("kvmesh_prompt_tokens_total", frozenset())] == 4
        assert series[("kvmesh_redis_connected", frozenset())] == 1
        worker = json.loads(generated.stdout)["worker_id"]
        pids = {w["worker_id"]: int(w["pid"]) for w in cli_json(env, "workers", address)}
        other = next(w for w in pids if w != worker)
        os.kill(pids[other], signal.SIGKILL)
        dead = ("kvmesh_workers", frozenset({("state", "dead")}))
        deadline = time.monotonic() + 30
        while scrape(metrics_port).get(dead) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert scrape(metrics_port)[dead] == 1
        assert scrape(metrics_port)[("kvmesh_worker_up", frozenset({("worker", other)}))] == 0
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
        assert up.returncode == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    documents = [json.loads(line) for line in err.splitlines() if line.strip()]
    requests = [d for d in documents if d["logger"] == "kvmesh.requests"]
    assert [d["request_id"] for d in requests] == [request_id]
    assert requests[0]["computed_tokens"] == 4 and requests[0]["worker"] == worker
    assert any(d["level"] == "warning" and other in d["message"] for d in documents)
