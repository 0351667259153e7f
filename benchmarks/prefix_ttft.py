"""The trials both GPU transfer benchmarks run: one 8K prompt whose 7.5K prefix is computed on
`source`, then served by `target` (pulling it), by `target` again (a local hit on the worker that
pulled: the fair baseline, as two workers can take different prefill paths, see
`workers/model/prefill_choice.py`) and by `source` (its local hit); and the pull alone, as the
pulling worker reports it.

The TTFT trials run twice: with the client in the benchmark's own process (which also holds the
coordinator and its gRPC server, so the two share one interpreter) and with the client in a
process of its own, as a real client is (`client_process_trials`, which runs this file).

Every measured hit follows one cold prompt on its worker's GPU by the same pause (`heat`): a GPU
that has just run an 8K prefill (~200 ms at its 700 W cap, the SM clock down to ~1.5 GHz) runs
the next ones a few percent slower for a while, so without it the request that happens to come
first after the source's cold prefix (the pulled one) paid for it and the later ones did not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

PROMPT, PREFIX = 8192, 7680
HEAT_GAP_S = 0.2
"""From the end of the cold prompt that heats a GPU to the measured request after it."""
TRIALS = 11
"""TTFT trials per client: one GPU's local hit moves by ~25 % from request to request, so the
medians (and the per-trial ratios) want more than a handful."""


def heat(client: Any, rand: Callable[[int], list[int]], worker: str) -> None:
    """A cold prompt on `worker`'s GPU, then `HEAT_GAP_S`: what every measured hit follows."""
    client.generate(rand(PROMPT), max_tokens=1, worker_id=worker)
    time.sleep(HEAT_GAP_S)


def prefix_ttft_trials(
    client: Any, rand: Callable[[int], list[int]], source: str, target: str, trials: int = 5
) -> dict[str, Any]:
    """Median TTFT (client-side) of cold / pulled / local-hit requests (the target's and the
    source's), the fewest tokens any pulled request reported pulling, and the median of each
    trial's pulled / local ratio on the target (`pulled_over_local_paired`)."""
    samples: dict[str, list[float]] = {"cold_ms": [], "pulled_ms": [], "local_hit_ms": []}
    samples["target_local_hit_ms"] = []
    pulled_tokens = []
    # Two tokens, so the first is not the request's last output: a worker sends a last output
    # only after announcing the request's blocks, which no first token of a real answer waits for.
    answer = 2
    for _ in range(trials):
        prefix = rand(PREFIX)
        cold = client.generate(prefix + rand(PROMPT - PREFIX), max_tokens=answer, worker_id=source)
        heat(client, rand, target)  # meanwhile the index learns the source's blocks
        pulled = client.generate(
            prefix + rand(PROMPT - PREFIX), max_tokens=answer, worker_id=target
        )
        heat(client, rand, target)
        again = client.generate(prefix + rand(PROMPT - PREFIX), max_tokens=answer, worker_id=target)
        heat(client, rand, source)
        local = client.generate(prefix + rand(PROMPT - PREFIX), max_tokens=answer, worker_id=source)
        samples["target_local_hit_ms"].append(again.ttft_ms or 0.0)
        samples["cold_ms"].append(cold.ttft_ms or 0.0)
        samples["pulled_ms"].append(pulled.ttft_ms or 0.0)
        samples["local_hit_ms"].append(local.ttft_ms or 0.0)
        pulled_tokens.append(pulled.pulled_tokens)
    out = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    out["pulled_tokens_min"] = float(min(pulled_tokens))
    # Paired: each trial's pulled request against the local hit right after it on the same
    # worker and prefix, so what drifts between trials (the GPU's clocks, the other worker's
    # work) cancels; the median of those ratios.
    pairs = zip(samples["pulled_ms"], samples["target_local_hit_ms"], strict=True)
    ratios = sorted(p / t for p, t in pairs if t)
    out["pulled_over_local_paired"] = ratios[len(ratios) // 2] if ratios else 0.0
    out["samples_ms"] = samples  # every trial, in order, for the report
    return out


def client_process_trials(
    address: str, source: str, target: str, seed: int, trials: int = TRIALS, vocab: int = 128000
) -> dict[str, Any]:
    """`prefix_ttft_trials` from a client in its own process; keys prefixed `client_process_`."""
    argv = [sys.executable, __file__, "--address", address, "--source", source]
    argv += ["--target", target, "--seed", str(seed), "--trials", str(trials)]
    argv += ["--vocab", str(vocab)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"client process failed: {done.stderr.strip()[-2000:]}")
    measured: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {f"client_process_{k}": v for k, v in measured.items()}


def worker_pull_trials(
    deployment: Any, client: Any, rand: Callable[[int], list[int]], source: str, target: str
) -> dict[str, Any]:
    """Pulls run by `target` itself (a request sent straight to its actor, no coordinator), 480
    blocks of a fresh prefix each time. Medians of: the pull's own time as the worker reports it
    (blocks reserved -> registered, calls to the peer included) and two parts of it (until the
    source answered; the engine call that wrote and registered), the actor's time to the first
    output with that pull vs with the same prefix already local, the worker's split of each
    (queued until its first step, the pull included; prefill), and one pin + unpin round trip
    to the source."""
    import ray

    from kvmesh.proto.block_hash import block_hashes
    from kvmesh.workers.contract.requests import PullSpec, SamplingConfig, WorkerRequest

    coordinator, cluster = deployment.coordinator, deployment.cluster
    root = coordinator.prompts.root_hash()
    block_size = coordinator.config.block_size
    transport = coordinator.transfers.transport(source, target)
    samples: dict[str, list[float]] = {"pull_ms": [], "actor_pulled_ms": [], "actor_local_ms": []}
    for key in ("pull_source_ms", "pull_write_ms", "pin_round_trip_ms"):
        samples[key] = []
    for key in ("pulled_queued_ms", "pulled_prefill_ms"):
        samples[key] = []
    samples.update(local_queued_ms=[], local_prefill_ms=[], actor_target_local_ms=[])
    samples.update(target_local_queued_ms=[], target_local_prefill_ms=[])
    num_blocks = []

    def first_output(worker: str, rid: str, prompt: list[int], spec: PullSpec | None) -> Any:
        request = WorkerRequest(rid, tuple(prompt), SamplingConfig(1), "", spec)
        start = time.perf_counter()
        outputs = cluster.generate(worker, request)  # the worker's stream, no routing
        out = next(outputs)
        took = (time.perf_counter() - start) * 1e3
        outputs.close()
        return out, took

    for k in range(4):
        prefix = rand(PREFIX)
        client.generate(prefix + [1], max_tokens=1, worker_id=source)
        hashes = tuple(block_hashes(prefix, block_size, root))
        start = time.perf_counter()
        ids = ray.get(cluster.actor(source).pin_blocks.remote(list(hashes)))
        ray.get(cluster.actor(source).unpin_blocks.remote(ids))
        samples["pin_round_trip_ms"].append((time.perf_counter() - start) * 1e3)
        tail = rand(PROMPT - PREFIX)
        spec = PullSpec(source, 0, hashes, transport)
        heat(client, rand, target)
        out, pulled_ms = first_output(target, f"bare-pull-{k}", prefix + tail, spec)
        heat(client, rand, target)
        again, again_ms = first_output(
            target, f"bare-again-{k}", prefix + rand(PROMPT - PREFIX), None
        )
        heat(client, rand, source)
        local, local_ms = first_output(
            source, f"bare-local-{k}", prefix + rand(PROMPT - PREFIX), None
        )
        samples["pull_ms"].append(out.prefill.pull_ms)
        samples["pull_source_ms"].append(out.prefill.pull_source_ms)
        samples["pull_write_ms"].append(out.prefill.pull_write_ms)
        samples["actor_target_local_ms"].append(again_ms)
        facts_of = {"pulled": out.prefill, "local": local.prefill, "target_local": again.prefill}
        for name, facts in facts_of.items():
            samples[f"{name}_queued_ms"].append(facts.queued_ms)
            samples[f"{name}_prefill_ms"].append(facts.prefill_ms)
        samples["actor_pulled_ms"].append(pulled_ms)
        samples["actor_local_ms"].append(local_ms)
        num_blocks.append(out.prefill.pulled_tokens // block_size)
    result: dict[str, Any] = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    result.update(transport=transport.value, pull_blocks=min(num_blocks))
    return result


def main() -> None:
    """The client's side of `client_process_trials`: one JSON line of medians on stdout."""
    import torch

    from kvmesh.client import Client

    ap = argparse.ArgumentParser(description="TTFT trials from a client in its own process")
    ap.add_argument("--address", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", type=int, default=TRIALS)
    ap.add_argument("--vocab", type=int, default=128000, help="token ids drawn below this")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    rand = lambda n: torch.randint(0, args.vocab, (n,), generator=g).tolist()  # noqa: E731
    with Client(args.address, timeout_s=300) as client:
        out = prefix_ttft_trials(client, rand, args.source, args.target, args.trials)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
