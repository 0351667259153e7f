"""kvmesh in front of two real vLLM servers vs round-robin over them, and the rate at which
vLLM-format KV events enter the index.

Usage (after `make vllm-venv`):
    python benchmarks/vllm_fleet.py [--groups 8] [--per-group 4] [--json PATH]
    python benchmarks/vllm_fleet.py --ingest-only

Model: a random Llama (vocab 512; 8 layers of 512 by default, so that a 552-token prefill
costs a visible fraction of a second on one CPU thread).

Workload: `groups` shared prefixes of 4 full blocks (4 x 128 tokens, vLLM's CPU block size),
each asked `per-group` times with a fresh 40-token suffix, in shuffled order, one request at a
time (this machine's two cores run both engines). Compared, each on fresh prefixes:

    direct round-robin   the client alternates between the two vLLM servers (no kvmesh)
    kvmesh round_robin   through kvmesh's OpenAI front door, policy round_robin
    kvmesh               through kvmesh, its cost model fed by the engines' KV events

Hit rate is vLLM's own: the sum of `usage.prompt_tokens_details.cached_tokens` over the sum of
prompt tokens. TTFT is client-side, to the first streamed chunk (sent once the first token
exists, by vLLM and by kvmesh alike).

Ingestion: vLLM map-encoded batches (one `BlockStored` of a new prompt's 4 blocks each, as a
real engine sends them) decoded, re-hashed into kvmesh's chain and published to a real Redis
through the same Lua script workers use.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.vllm

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig  # noqa: E402
from kvmesh.coordinator.cluster.redis_server import start_redis_server  # noqa: E402
from kvmesh.coordinator.config import CoordinatorConfig, HttpConfig  # noqa: E402
from kvmesh.coordinator.engines import vllm_events  # noqa: E402
from kvmesh.coordinator.engines.chain_translator import ChainTranslator  # noqa: E402
from kvmesh.coordinator.engines.engine_fleet import EngineSpec  # noqa: E402
from kvmesh.coordinator.engines.index_feed import EngineIndexFeed  # noqa: E402
from kvmesh.proto.block_hash import namespace_hash  # noqa: E402
from kvmesh.workers.engine.event_publisher import EventPublisher  # noqa: E402
from tests.vllm.vllm_server import (  # noqa: E402
    CPU_BLOCK_SIZE,
    VllmServer,
    start_vllm,
    write_tiny_llama,
)

PREFIX_BLOCKS = 4
SUFFIX_LEN = 40
MAX_TOKENS = 4


def stream_completion(base_url: str, model: str, prompt: list[int]) -> tuple[float, int, int]:
    """(TTFT in ms, prompt tokens, cached tokens) of one streamed completion."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.netloc, timeout=300)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    ttft_ms = -1.0
    usage: dict[str, Any] = {}
    for raw in iter(response.readline, b""):
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if ttft_ms < 0 and chunk.get("choices"):
            # vLLM and kvmesh both send their first chunk once the first token exists (its text
            # may be empty: a byte that starts a multi-byte character, or no detokenizer)
            ttft_ms = (time.perf_counter() - started) * 1e3
        usage = chunk.get("usage") or usage
    conn.close()
    details = usage.get("prompt_tokens_details") or {}
    return ttft_ms, int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)


def workload(seed: int, groups: int, per_group: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 512) for _ in range(PREFIX_BLOCKS * CPU_BLOCK_SIZE)]
        for _ in range(groups)
    ]
    prompts = [
        p + [rng.randrange(3, 512) for _ in range(SUFFIX_LEN)]
        for p in prefixes
        for _ in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


Sample = tuple[float, int, int]
"""(TTFT ms, prompt tokens, cached tokens) of one request."""


def run_mode(urls: list[str], model: str, prompts: list[list[int]]) -> list[Sample]:
    samples = []
    for i, prompt in enumerate(prompts):
        samples.append(stream_completion(urls[i % len(urls)], model, prompt))
        time.sleep(0.05)  # the index hears the engine's events (they follow each step)
    return samples


def summarize(samples: list[Sample]) -> dict[str, float]:
    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")

    ttfts = [t for t, _, _ in samples]
    hits = [t for t, _, c in samples if c > 0]
    misses = [t for t, _, c in samples if c == 0]
    return {
        "requests": len(samples),
        "hit_rate": sum(c for _, _, c in samples) / sum(n for _, n, _ in samples),
        "ttft_mean_ms": statistics.fmean(ttfts),
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p90_ms": pct(ttfts, 0.9),
        "requests_with_a_hit": len(hits),
        "ttft_hit_p50_ms": pct(hits, 0.5),
        "ttft_miss_p50_ms": pct(misses, 0.5),
    }


def kvmesh_mode(
    model_dir: Path, engines: list[VllmServer], policy: str, prompts: list[list[int]]
) -> list[Sample]:
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(
            model=str(model_dir), block_size=CPU_BLOCK_SIZE, port=0, policy=policy
        ),
        num_workers=0,
        engines=tuple(EngineSpec.parse(s.engine_spec) for s in engines),
        http=HttpConfig(port=0),
    )
    deployment = Deployment(config)
    deployment.start()
    try:
        return run_mode([deployment.http_url], str(model_dir), prompts)
    finally:
        deployment.stop()


MODES = ("direct round-robin", "kvmesh round_robin", "kvmesh")


def fleet_benchmark(
    groups: int, per_group: int, rounds: int, hidden_size: int, num_layers: int
) -> dict[str, dict[str, float]]:
    """`rounds` rounds, each mode once per round on fresh prefixes; the mode order rotates from
    round to round (so no mode always runs first, on the coldest engines)."""
    samples: dict[str, list[Sample]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_llama(
            Path(tmp) / "model", hidden_size=hidden_size, num_layers=num_layers
        )
        engines = [start_vllm(n, model_dir, Path(tmp)) for n in ("a", "b")]
        try:
            for e in engines:
                e.wait_ready()
            # warm-up: a hit and a miss on each engine (first calls compile; not measured)
            for warm in workload(99, 2, 2):
                for e in engines:
                    stream_completion(e.base_url, str(model_dir), warm)
            urls = [e.base_url for e in engines]
            for r in range(rounds):
                for k in range(len(MODES)):
                    mode = MODES[(r + k) % len(MODES)]
                    prompts = workload(100 * r + k, groups, per_group)
                    if mode == "direct round-robin":
                        samples[mode] += run_mode(urls, str(model_dir), prompts)
                    else:
                        policy = "kvmesh" if mode == "kvmesh" else "round_robin"
                        samples[mode] += kvmesh_mode(model_dir, engines, policy, prompts)
        finally:
            for e in engines:
                e.kill()
    return {m: summarize(v) for m, v in samples.items()}


def ingestion_benchmark(num_batches: int = 4000) -> dict[str, float]:
    """Events per second decoded, re-hashed and published (one BlockStored of 4 blocks each)."""
    rng = random.Random(5)
    payloads = []
    for i in range(num_batches):
        tokens = [rng.randrange(0, 512) for _ in range(PREFIX_BLOCKS * CPU_BLOCK_SIZE)]
        hashes = [i * 8 + k + 1 for k in range(PREFIX_BLOCKS)]
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": CPU_BLOCK_SIZE,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        payloads.append(msgpack.packb([time.time(), [event], 0]))
    root = namespace_hash("bench")

    def fresh_translator() -> ChainTranslator:
        return ChainTranslator(CPU_BLOCK_SIZE, lambda _lora, _salt: root)

    started = time.perf_counter()
    batches = [vllm_events.decode_payload(p) for p in payloads]
    decode_s = time.perf_counter() - started

    translator = fresh_translator()
    started = time.perf_counter()
    for b in batches:
        for e in b.events:
            translator.translate(e)
    translate_s = time.perf_counter() - started

    redis = start_redis_server()
    try:
        feed = EngineIndexFeed(
            "bench", fresh_translator(), EventPublisher(redis.url, "ns", "bench")
        )
        started = time.perf_counter()
        for p in payloads:
            feed.on_batch(vllm_events.decode_payload(p))
        total_s = time.perf_counter() - started
        feed.publisher.close()
    finally:
        redis.stop()
    blocks = num_batches * PREFIX_BLOCKS
    return {
        "batches": num_batches,
        "blocks": blocks,
        "decode_events_per_s": num_batches / decode_s,
        "rehash_blocks_per_s": blocks / translate_s,
        "into_redis_events_per_s": num_batches / total_s,
        "into_redis_blocks_per_s": blocks / total_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--hidden-size", type=int, default=512, help="of the random Llama (prefill must cost)"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ingest-only", action="store_true")
    parser.add_argument("--json", default="bench-results/vllm_fleet.json")
    args = parser.parse_args()
    out: dict[str, Any] = {"ingestion": ingestion_benchmark()}
    print("ingestion of vLLM-format events:", json.dumps(out["ingestion"], indent=1))
    if not args.ingest_only:
        out["model"] = {"hidden_size": args.hidden_size, "layers": args.layers, "vocab": 512}
        out["fleet"] = fleet_benchmark(
            args.groups, args.per_group, args.rounds, args.hidden_size, args.layers
        )
        print(
            f"{'mode':<20} {'hit rate':>8} {'hits':>5} {'TTFT mean':>10} {'p50':>8} {'p90':>8}"
            f" {'hit p50':>8} {'miss p50':>8}"
        )
        for mode, r in out["fleet"].items():
            print(
                f"{mode:<20} {r['hit_rate']:>8.3f} {r['requests_with_a_hit']:>2}/{r['requests']:<2}"
                f" {r['ttft_mean_ms']:>8.1f}ms {r['ttft_p50_ms']:>6.1f}ms"
                f" {r['ttft_p90_ms']:>6.1f}ms {r['ttft_hit_p50_ms']:>6.1f}ms"
                f" {r['ttft_miss_p50_ms']:>6.1f}ms"
            )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
