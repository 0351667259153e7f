"""`make demo`: start a local cluster, send a shared-prefix workload, show where the cache helped.

Runs `kvmesh up` (embedded Redis, local Ray, 2 `tiny-random` workers, the coordinator) as a child
process, drives it through the Python client, prints one row per request, and stops everything.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

from kvmesh.client.client import Client
from kvmesh.client.table import format_table

SYSTEM_PROMPTS = {
    "support": "You are the support assistant of a bike shop. Answer briefly and politely, "
    "and always suggest a visit to the workshop when a repair is needed. ",
    "travel": "You are a travel planner. Give concrete day-by-day plans with train times, "
    "budget estimates in euros and one local food tip per day. ",
    "code": "You are a senior Python reviewer. Point out bugs first, then style issues, and "
    "quote the offending line each time. ",
}
QUESTIONS = [
    "How do I fix a flat tyre?",
    "Plan three days in Lyon.",
    "Review: def f(x): return x+1",
    "My brakes squeak, why?",
]

_READY = re.compile(r"kvmesh is up at (\S+)")


def start_cluster(workers: int, timeout_s: float) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.client.cli",
        "up",
        "--workers",
        str(workers),
        "--port",
        "0",
        "--log-level",
        "warning",  # the demo prints its own table; one log line per request would bury it
    ]
    env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        print(f"  {line.rstrip()}")
        match = _READY.search(line)
        if match:
            return proc, match.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the local cluster did not start (exit code {proc.returncode})")


def run_workload(address: str, rounds: int, max_tokens: int) -> list[list[str]]:
    rows: list[list[str]] = []
    with Client(address, timeout_s=60) as client:
        client.wait_ready(30)
        for r in range(rounds):
            for name, system in SYSTEM_PROMPTS.items():
                question = QUESTIONS[(r + len(name)) % len(QUESTIONS)]
                res = client.generate(prompt=system + question, max_tokens=max_tokens)
                rows.append(
                    [
                        str(len(rows) + 1),
                        name,
                        res.worker_id,
                        str(res.prompt_tokens),
                        str(res.cached_tokens),
                        str(res.computed_tokens),
                        f"{res.ttft_ms or 0:.1f}",
                        repr(res.text[:16]),
                    ]
                )
                time.sleep(0.02)  # let the index catch up, as a real client's think time would
        stats = client.stats()
    rows.append(
        [
            "",
            "total",
            "",
            str(stats.prompt_tokens),
            str(stats.cached_tokens),
            str(stats.computed_tokens),
            "",
            f"hit rate {stats.hit_rate:.0%}",
        ]
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh-demo", description=__doc__)
    parser.add_argument("--workers", type=int, default=2, help="worker actors to start (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the workload (default 3)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (default 8)")
    parser.add_argument("--timeout", type=float, default=180, help="start-up timeout in seconds")
    args = parser.parse_args(argv)
    print("Starting a local kvmesh cluster (Redis + Ray + workers + coordinator) ...")
    try:
        proc, address = start_cluster(args.workers, args.timeout)
    except RuntimeError as exc:
        print(f"kvmesh-demo: error: {exc}", file=sys.stderr)
        return 1
    try:
        rows = run_workload(address, args.rounds, args.max_tokens)
        header = ["#", "prompt", "worker", "prompt_tok", "cached", "computed", "ttft_ms", "text"]
        print()
        print(format_table(header, rows))
        print("\nRequests that share a system prompt land on the worker that already holds it;")
        print("'cached' tokens were not recomputed. The random-weight model's text is noise.")
        return 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        print("Cluster stopped.")


if __name__ == "__main__":
    sys.exit(main())
