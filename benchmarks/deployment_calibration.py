"""What the simulator's step model needs, measured in the deployment an end-to-end run judges.

`gpu_e2e.py --calibrate` runs this on its first deployment, after the warm-up and before the
sweep: the same workers, coordinator, Redis, host and client process as the sweep it calibrates.
Every request is pinned to a worker (no routing) and uses the workload's shapes with fresh
random tokens (never the workload's prompts):

  1. hits and cold prompts, one at a time on an idle worker (the peer idle), every worker in
     turn: a cold prompt of S + Q tokens (the workload's system prompt and question), then a hit
     (the same S-token prefix, a new Q-token question), each O tokens long (the workload's
     answer). Twice: through the service (the client in this process, as the sweep's; its TTFT,
     each token's arrival and the stream's end), and calling the worker's actor directly from
     the coordinator's process (the worker's own `queued_ms` / `prefill_ms` split and the
     tokens' arrivals there). The first trial of each pass meets its path for the first time
     and is left out.
  2. decode: B sequences (a cached S-token prefix, a fresh Q-token question, D tokens each) on
     every worker at once, for each B of `--calibrate-batches`: through the actor (the worker's
     step: its output stream's time per token) and through the service (the client's time per
     token between tokens, and the sweep's TPOT, (end - first) / (tokens - 1)).
  3. batched hits: on every worker at once, a cold prompt, then, once it runs, B hits (a cached
     S-token prefix, a fresh Q-token question, O tokens) for each B of `--calibrate-batches`:
     they queue behind it and one prefill step admits them all, as the hits waiting behind a
     long prefill on a loaded worker. The worker's `prefill_ms` of each hit is that step.

The worker does not report its host time per step apart from its forward; `coordinator/sim/
calibration.py` keeps the GPU terms of its base model and counts the rest of the step as host
time. The figures are medians over trials, workers and streams; the raw lists are kept beside
them (`trials`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvmesh.client.async_client import AsyncClient
from kvmesh.coordinator.cluster.cluster import Cluster
from kvmesh.coordinator.sim.calibration import (
    BatchedHits,
    DecodeTiming,
    DeploymentCalibration,
    PromptTiming,
    StreamEnd,
)
from kvmesh.workers.contract.replies import PrefillFacts
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest

HEAD_START_S = 0.03
"""How long the batched hits wait after their cold prompt is sent: enough for it to reach its
worker and start its step (a cold 8K prefill takes ~0.2 s on an H100), so the hits queue."""
BATCHED_ROUNDS = 3
"""Rounds of each batch of hits; the first (new shapes for the kernels) is left out."""


@dataclass(frozen=True, slots=True)
class CalibrationShape:
    """The workload's shapes and how long to measure them."""

    system_len: int
    question_len: int
    output_len: int
    vocab_size: int
    batches: tuple[int, ...]
    """Sequences per worker in the decode phase."""
    decode_tokens: int
    """Tokens each decode-phase sequence generates."""
    trials: int
    """Hits (and cold prompts) per worker and pass, after the one left out."""
    seed: int


@dataclass(frozen=True, slots=True)
class TokenTimes:
    """One stream as one reader saw it (ms from sending the request)."""

    token_ms: tuple[float, ...]
    """Each token's arrival (tokens joined in one message share its time)."""
    end_ms: float
    """The stream's end (its last message read and the stream closed)."""
    prefill: PrefillFacts | None = None
    """The worker's facts (the actor's reads only)."""
    cached_tokens: int = 0

    @property
    def ttft_ms(self) -> float:
        return self.token_ms[0]

    def mid_gap_ms(self) -> float:
        """Mean gap between the first token and the one before the last."""
        n = len(self.token_ms)
        return (self.token_ms[n - 2] - self.token_ms[0]) / max(1, n - 2)

    def end_gap_ms(self) -> float:
        """From the token before the last to the stream's end."""
        return self.end_ms - self.token_ms[-2]

    def gaps_ms(self) -> list[float]:
        """Time per token between arrivals (a message of k tokens: its gap over k each)."""
        out, last, run = [], self.token_ms[0], 0
        for t in self.token_ms[1:]:
            run += 1
            if t > last:
                out.extend([(t - last) / run] * run)
                last, run = t, 0
        return out

    def tpot_ms(self) -> float:
        """As the sweep reports it (`BenchSample.tpot_ms`)."""
        return (self.end_ms - self.token_ms[0]) / (len(self.token_ms) - 1)


async def client_stream(
    client: AsyncClient, prompt: list[int], max_tokens: int, worker_id: str
) -> TokenTimes:
    """Through the service, pinned to `worker_id`."""
    token_ms: list[float] = []
    cached = 0
    started = time.perf_counter()
    chunks = client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, worker_id=worker_id)
    async for chunk in chunks:
        now = (time.perf_counter() - started) * 1e3
        token_ms.extend([now] * len(chunk.token_ids))
        if chunk.cache is not None:
            cached = chunk.cache.cached_tokens
    return TokenTimes(tuple(token_ms), (time.perf_counter() - started) * 1e3, None, cached)


def actor_stream(
    cluster: Cluster, worker_id: str, prompt: list[int], max_tokens: int
) -> TokenTimes:
    """The worker's actor called from the coordinator's process (no routing, no gRPC)."""
    request = WorkerRequest(
        f"calibrate-{time.monotonic_ns()}",
        tuple(prompt),
        SamplingConfig(max_tokens, ignore_eos=True),
    )
    token_ms: list[float] = []
    prefill: PrefillFacts | None = None
    started = time.perf_counter()
    for out in cluster.generate(worker_id, request):
        now = (time.perf_counter() - started) * 1e3
        token_ms.extend([now] * len(out.new_token_ids))
        prefill = prefill or out.prefill
    cached = prefill.cached_tokens if prefill is not None else 0
    return TokenTimes(tuple(token_ms), (time.perf_counter() - started) * 1e3, prefill, cached)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


class Calibration:
    """One deployment's calibration run (`run`), on a client and the coordinator's `Cluster`."""

    def __init__(
        self, client: AsyncClient, cluster: Cluster, worker_ids: list[str], shape: CalibrationShape
    ) -> None:
        self.client, self.cluster, self.worker_ids, self.shape = client, cluster, worker_ids, shape
        self.rng = np.random.default_rng([shape.seed, 17])
        self.prefixes: dict[str, list[int]] = {}
        """Per worker, a prefix it holds (for the decode phase's prompts)."""

    def tokens(self, n: int) -> list[int]:
        return list(self.rng.integers(0, self.shape.vocab_size, n).tolist())

    async def _pair(self, worker_id: str, via_actor: bool) -> tuple[TokenTimes, TokenTimes]:
        """A cold prompt, then a hit behind its prefix, on one worker."""
        s = self.shape
        prefix = self.tokens(s.system_len)
        self.prefixes[worker_id] = prefix
        cold, hit = prefix + self.tokens(s.question_len), prefix + self.tokens(s.question_len)
        if via_actor:
            run = asyncio.to_thread
            got_cold = await run(actor_stream, self.cluster, worker_id, cold, s.output_len)
            got_hit = await run(actor_stream, self.cluster, worker_id, hit, s.output_len)
        else:
            got_cold = await client_stream(self.client, cold, s.output_len, worker_id)
            got_hit = await client_stream(self.client, hit, s.output_len, worker_id)
        return got_cold, got_hit

    async def prompts(self) -> dict[str, dict[str, list[TokenTimes]]]:
        """Phase 1: per pass ("client", "actor"), the cold prompts' and the hits' streams."""
        out: dict[str, dict[str, list[TokenTimes]]] = {}
        for via_actor, name in ((False, "client"), (True, "actor")):
            colds, hits = [], []
            for trial in range(self.shape.trials + 1):
                for worker_id in self.worker_ids:
                    cold, hit = await self._pair(worker_id, via_actor)
                    if trial:
                        colds.append(cold)
                        hits.append(hit)
            out[name] = {"cold": colds, "hit": hits}
        return out

    def _decode_prompts(self, batch: int) -> list[tuple[str, list[int]]]:
        q = self.shape.question_len
        return [
            (w, self.prefixes[w] + self.tokens(q)) for w in self.worker_ids for _ in range(batch)
        ]

    async def decode(self, batch: int) -> tuple[list[TokenTimes], list[TokenTimes]]:
        """Phase 2 at one batch: the actor's streams, then the client's."""
        n = self.shape.decode_tokens
        prompts = self._decode_prompts(batch)

        def through_actors() -> list[TokenTimes]:
            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(pool.map(lambda wp: actor_stream(self.cluster, *wp, n), prompts))

        actor = await asyncio.to_thread(through_actors)
        prompts = self._decode_prompts(batch)
        client = await asyncio.gather(*(client_stream(self.client, p, n, w) for w, p in prompts))
        return actor, list(client)

    def _hits_behind_cold(self, worker_id: str, batch: int) -> list[TokenTimes]:
        """One round on one worker: a cold prompt, then `batch` hits sent while it runs."""
        s = self.shape
        cold = self.tokens(s.system_len + s.question_len)
        hits = [self.prefixes[worker_id] + self.tokens(s.question_len) for _ in range(batch)]
        with ThreadPoolExecutor(batch + 1) as pool:
            head = pool.submit(actor_stream, self.cluster, worker_id, cold, 1)
            time.sleep(HEAD_START_S)
            got = list(
                pool.map(lambda p: actor_stream(self.cluster, worker_id, p, s.output_len), hits)
            )
            head.result()
        return got

    async def batched_hits(self, batch: int) -> list[TokenTimes]:
        """Phase 3 at one batch: the hits' actor streams, every worker at once, the first round
        left out."""

        def rounds() -> list[TokenTimes]:
            out: list[TokenTimes] = []
            with ThreadPoolExecutor(len(self.worker_ids)) as pool:
                for i in range(BATCHED_ROUNDS):
                    got = pool.map(lambda w: self._hits_behind_cold(w, batch), self.worker_ids)
                    out += [t for per_worker in got for t in per_worker] if i else []
            return out

        return await asyncio.to_thread(rounds)

    async def run(self) -> dict[str, Any]:
        """The `calibration` block: `DeploymentCalibration.as_dict()`, the raw lists, the time."""
        started = time.monotonic()
        s = self.shape
        streams = await self.prompts()
        decode_rows: list[DecodeTiming] = []
        trials = raw_prompt_trials(streams)
        for batch in s.batches:
            actor, client = await self.decode(batch)
            steps = [g for t in actor for g in t.gaps_ms()]
            decode_rows.append(
                DecodeTiming(
                    batch=batch,
                    num_streams=batch * len(self.worker_ids),
                    context_tokens_per_seq=s.system_len + s.question_len + s.decode_tokens / 2,
                    worker_step_ms=median(steps),
                    client_gap_ms=median([g for t in client for g in t.gaps_ms()[:-1]]),
                    client_tpot_ms=median([t.tpot_ms() for t in client]),
                )
            )
            trials[f"decode_b{batch}_worker_step_ms"] = steps
        batched_rows: list[BatchedHits] = []
        for batch in s.batches:
            facts = [t.prefill for t in await self.batched_hits(batch) if t.prefill is not None]
            batched_rows.append(BatchedHits(batch, median([f.prefill_ms for f in facts])))
            trials[f"batched_b{batch}_worker_prefill_ms"] = [f.prefill_ms for f in facts]
            trials[f"batched_b{batch}_worker_queued_ms"] = [f.queued_ms for f in facts]
        actor_hits, client_hits = streams["actor"]["hit"], streams["client"]["hit"]
        calibration = DeploymentCalibration(
            num_workers=len(self.worker_ids),
            hit=timing(streams["client"]["hit"], actor_hits),
            cold=timing(streams["client"]["cold"], streams["actor"]["cold"]),
            decode=tuple(decode_rows),
            stream_end=StreamEnd(
                output_len=s.output_len,
                client_mid_gap_ms=median([t.mid_gap_ms() for t in client_hits]),
                client_end_gap_ms=median([t.end_gap_ms() for t in client_hits]),
                actor_mid_gap_ms=median([t.mid_gap_ms() for t in actor_hits]),
                actor_end_gap_ms=median([t.end_gap_ms() for t in actor_hits]),
            ),
            batched=tuple(batched_rows),
        )
        return {
            **calibration.as_dict(),
            "shape": asdict(s),
            "trials": trials,
            "wall_s": time.monotonic() - started,
        }


def raw_prompt_trials(streams: dict[str, dict[str, list[TokenTimes]]]) -> dict[str, Any]:
    """Phase 1's figures one by one, beside the medians the block keeps."""
    trials: dict[str, Any] = {
        f"{name}_{kind}_ttft_ms": [t.ttft_ms for t in got]
        for name, per in streams.items()
        for kind, got in per.items()
    }
    for kind, got in streams["actor"].items():
        facts = [t.prefill for t in got if t.prefill is not None]
        trials[f"worker_{kind}_queued_ms"] = [f.queued_ms for f in facts]
        trials[f"worker_{kind}_prefill_ms"] = [f.prefill_ms for f in facts]
    # the client's hits reused what the worker's did (the fit reads the worker's facts)
    trials["client_hit_cached_tokens"] = [t.cached_tokens for t in streams["client"]["hit"]]
    return trials


def timing(client: list[TokenTimes], actor: list[TokenTimes]) -> PromptTiming:
    """One prompt shape's medians: the client's TTFT, the actor's, and the worker's split."""
    facts = [t.prefill for t in actor if t.prefill is not None]
    return PromptTiming(
        new_tokens=int(statistics.median(f.computed_tokens for f in facts)),
        cached_tokens=int(statistics.median(f.cached_tokens for f in facts)),
        client_ttft_ms=median([t.ttft_ms for t in client]),
        actor_ttft_ms=median([t.ttft_ms for t in actor]),
        worker_queued_ms=median([f.queued_ms for f in facts]),
        worker_prefill_ms=median([f.prefill_ms for f in facts]),
    )


def print_summary(block: dict[str, Any]) -> None:
    """The figures in one glance (the JSON holds them all)."""
    for kind in ("hit", "cold"):
        p = block[kind]
        print(
            f"  calibration {kind}: {p['new_tokens']} new behind {p['cached_tokens']}: client "
            f"TTFT {p['client_ttft_ms']:.1f} ms, actor {p['actor_ttft_ms']:.1f}, worker queued "
            f"{p['worker_queued_ms']:.1f} + prefill {p['worker_prefill_ms']:.1f}",
            flush=True,
        )
    for d in block["decode"]:
        print(
            f"  calibration decode b{d['batch']} x {block['num_workers']} workers: worker step "
            f"{d['worker_step_ms']:.2f} ms, client gap {d['client_gap_ms']:.2f}, client TPOT "
            f"{d['client_tpot_ms']:.2f}",
            flush=True,
        )
    for b in block.get("batched", ()):
        queued = block["trials"][f"batched_b{b['batch']}_worker_queued_ms"]
        print(
            f"  calibration {b['batch']} hits batched behind a cold prompt: worker prefill "
            f"{b['worker_prefill_ms']:.2f} ms (queued {median(queued):.1f})",
            flush=True,
        )
    cached = block["trials"]["client_hit_cached_tokens"]
    print(f"  calibration client hits reused {min(cached)}-{max(cached)} tokens", flush=True)
    e = block["stream_end"]
    print(
        f"  calibration {e['output_len']}-token stream: client mid gap "
        f"{e['client_mid_gap_ms']:.2f} ms, end gap {e['client_end_gap_ms']:.2f}; actor "
        f"{e['actor_mid_gap_ms']:.2f}, {e['actor_end_gap_ms']:.2f} ({block['wall_s']:.1f} s)",
        flush=True,
    )
