"""The load of one rate of a TTFT-vs-rate sweep: every request of a schedule sent at its time
(open loop), each answer streamed to its end.

`fire_schedule` sends from the caller's event loop. `fire_in_own_process` runs the same in a
process of its own (this file), as a real client is: a client that shares its interpreter with
the coordinator and its gRPC server competes with them for one GIL, and under load its sends can
leave late and bunch up. Both report how late each request left against its send time.

    parent:  schedule -> temp JSON -> python rate_client.py --address A --schedule F ...
    child:   AsyncClient, fire_schedule -> one JSON line on stdout: samples, wall, lateness
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvmesh.client.async_client import AsyncClient
from kvmesh.client.bench import BenchSample
from kvmesh.client.errors import KVMeshError

Schedule = list[tuple[float, list[int]]]
"""(send time in seconds from the start, prompt token ids), in send order."""


async def send_one(
    client: AsyncClient, prompt: list[int], max_tokens: int, **pin: str
) -> BenchSample:
    """One request streamed to its end (`pin`: e.g. worker_id=...); a failure is a sample."""
    try:
        r = await client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, **pin)
    except KVMeshError as err:
        return BenchSample.of_error(len(prompt), err)
    return BenchSample.of_result(r)


async def fire_schedule(
    client: AsyncClient, schedule: Schedule, max_tokens: int
) -> tuple[list[BenchSample], float, list[float]]:
    """The samples (in schedule order), the wall time, and how late each request left (ms)."""
    late_ms: list[float] = []

    async def fire(at_s: float, prompt: list[int]) -> BenchSample:
        await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
        late_ms.append((time.perf_counter() - start - at_s) * 1e3)
        return await send_one(client, prompt, max_tokens)

    start = time.perf_counter()
    samples = await asyncio.gather(*(fire(t, p) for t, p in schedule))
    return list(samples), time.perf_counter() - start, late_ms


def fire_in_own_process(
    address: str, schedule: Schedule, max_tokens: int, request_timeout_s: float
) -> tuple[list[BenchSample], float, list[float]]:
    """`fire_schedule` from a client process of its own (started, connected and ready before
    its clock starts); raises if that process fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "schedule.json"
        path.write_text(json.dumps([[t, p] for t, p in schedule]))
        argv = [sys.executable, __file__, "--address", address, "--schedule", str(path)]
        argv += ["--max-tokens", str(max_tokens), "--request-timeout", str(request_timeout_s)]
        last_send = schedule[-1][0] if schedule else 0.0
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=last_send + request_timeout_s + 120
        )
    if done.returncode != 0:
        raise RuntimeError(f"rate client failed: {done.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    samples = [BenchSample(**s) for s in out["samples"]]
    return samples, float(out["wall_s"]), [float(x) for x in out["late_ms"]]


async def _serve(address: str, schedule: Schedule, max_tokens: int, timeout_s: float) -> str:
    async with AsyncClient(address, timeout_s=timeout_s) as client:
        await client.wait_ready(30.0)
        samples, wall_s, late_ms = await fire_schedule(client, schedule, max_tokens)
    return json.dumps(
        {"samples": [asdict(s) for s in samples], "wall_s": wall_s, "late_ms": late_ms}
    )


def main() -> None:
    ap = argparse.ArgumentParser(description="send one rate's schedule from a process of its own")
    ap.add_argument("--address", required=True, help="the coordinator's gRPC address")
    ap.add_argument("--schedule", type=Path, required=True, help="JSON [[send_s, tokens], ...]")
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    args = ap.parse_args()
    schedule = [(float(t), list(p)) for t, p in json.loads(args.schedule.read_text())]
    print(asyncio.run(_serve(args.address, schedule, args.max_tokens, args.request_timeout)))


if __name__ == "__main__":
    main()
