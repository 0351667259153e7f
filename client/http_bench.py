"""`kvmesh bench --http URL`: replay a workload over the OpenAI HTTP API instead of gRPC, so the
same requests can go through kvmesh's own front door or through any router that speaks OpenAI
(SGLang's, vLLM's) in front of kvmesh's per-worker endpoints.

Each request is a streamed `POST {URL}/v1/completions` with `stream_options.include_usage`:
TTFT is the time to the first chunk that carries text or a finish reason, the reused tokens come
from `usage.prompt_tokens_details.cached_tokens`, split into local hits and pulls, and the worker
taken from the `kvmesh` extension field (empty, and all counted local, if a router drops it).
Prompts go as text: token id t becomes the printable ASCII character 32 + t % 95, so on the
byte-level presets a prompt keeps its length and its shared prefixes, and a router that matches
prefixes by text (as SGLang's does) sees what kvmesh sees.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmesh.client.bench import BenchSample
from kvmesh.client.workloads import WorkloadRequest


def prompt_text(token_ids: np.ndarray | Sequence[int]) -> str:
    return "".join(chr(32 + int(t) % 95) for t in token_ids)


async def served_model(client: Any, url: str) -> str:
    response = await client.get(url + "/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def send(
    client: Any, url: str, model: str, request: WorkloadRequest, max_output: int | None
) -> BenchSample:
    """One streamed completion; failures become a failed sample, never an exception."""
    output_len = min(request.output_len, max_output) if max_output else request.output_len
    body = {
        "model": model,
        "prompt": prompt_text(request.token_ids),
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "session_id": request.session_id,
    }
    started = time.perf_counter()
    ttft_ms: float | None = None
    usage: dict[str, Any] = {}
    worker_id, pulled = "", 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return _failed(request, f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return _failed(request, str(chunk["error"].get("message", chunk)))
                choices = chunk.get("choices") or []
                if ttft_ms is None and choices and (choices[0].get("text") or choices[0].get(
                    "finish_reason"
                )):  # fmt: skip
                    ttft_ms = (time.perf_counter() - started) * 1e3
                usage = chunk.get("usage") or usage
                facts = chunk.get("kvmesh") or {}
                worker_id = facts.get("worker_id", worker_id)
                pulled = int(facts.get("pulled_tokens", pulled))
    except Exception as exc:  # connection refused, reset, timeout: the request failed
        return _failed(request, f"{type(exc).__name__}: {exc}")
    prompt_tokens = int(usage.get("prompt_tokens", request.prompt_len))
    details = usage.get("prompt_tokens_details") or {}
    reused = int(details.get("cached_tokens") or 0)  # OpenAI's count: local hits + pulls
    return BenchSample(True, worker_id, prompt_tokens, reused - pulled, pulled, ttft_ms)


def _failed(request: WorkloadRequest, error: str) -> BenchSample:
    return BenchSample(False, "", request.prompt_len, 0, 0, None, error)


async def drive(
    url: str,
    schedule: list[tuple[float, WorkloadRequest]],
    *,
    concurrency: int,
    timeout_s: float,
    max_output: int | None,
    api_key: str = "",
    model: str = "",
) -> tuple[list[BenchSample], str, float]:
    """Send the schedule open-loop; returns the samples, the model name and the elapsed time."""
    try:
        import httpx
    except ImportError:
        raise ValueError("bench --http needs httpx: pip install 'kvmesh[bench]'") from None
    from tqdm import tqdm

    url = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers, limits=limits) as client:
        model = model or await served_model(client, url)
        gate = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(schedule), unit="req", desc="kvmesh bench --http", file=sys.stderr)

        async def fire(at_s: float, request: WorkloadRequest) -> BenchSample:
            await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
            async with gate:
                sample = await send(client, url, model, request, max_output)
            bar.update(1)
            return sample

        start = time.perf_counter()
        samples = await asyncio.gather(*(fire(t, r) for t, r in schedule))
        elapsed = time.perf_counter() - start
        bar.close()
    return list(samples), model, elapsed
