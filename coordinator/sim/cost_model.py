"""What compute costs in the simulated cluster, and where the default numbers come from.

    prefill_ms(new, cached)  = prefill_fixed_ms + new * prefill_per_token_ms
                               + new * (cached * cached_attention_factor + new / 2)
                                 * attention_per_token_pair_ms
    decode_step_ms(batch, context_tokens)
                             = decode_fixed_ms + batch * decode_per_seq_ms
                               + context_tokens * decode_per_context_token_ms
                               + host_step_ms(batch)
    host_step_ms(seqs)       = host_step_fixed_ms
                               + seqs * (host_step_per_seq_ms + host_between_steps_per_seq_ms)
    prefill_batch_step_ms([(new_i, cached_i)])
                             = prefill_fixed_ms + sum_i (prefill_ms(new_i, cached_i)
                               - prefill_fixed_ms) + host_step_ms(len(chunks))
    delivery_ms(streams)     = delivery_fixed_ms + streams * delivery_per_stream_ms

A step is the GPU's work plus the engine's host work around it (scheduling, sampling, KV events,
handing outputs over): host time occupies the worker, so it delays the next step. Delivery is the
outputs' way from the worker to the client (the worker's stream to the coordinator, the
coordinator, gRPC): it delays each token the client sees but takes no worker time. Its cost per
token grows with the streams the coordinator carries at once (`coordinator/sim/delivery.py`).

Defaults model Llama-3-8B in bf16 on one H100 SXM, from ceilings measured on an H100 (bf16
matmul 790 TFLOP/s, pinned PCIe 55 GB/s, 2026-11-26) and the model's shape (32 layers, 4096 wide,
8 KV heads of 128, 8.03 B parameters):

  * prefill_per_token_ms 0.020: 2 x 8.03 GFLOP per token at the measured 790 TFLOP/s bf16 matmul
    rate is 20.3 us ("recomputing a token's prefill costs >= 20 us at peak").
  * attention_per_token_pair_ms 8.8e-7: causal SDPA over 8K tokens measured 0.92 ms per layer
    for 8192^2 / 2 = 33.5 M (query, key) pairs; x 32 layers = 29.4 ms / 33.5 M pairs.
  * prefill_fixed_ms 2.0: launch and scheduling overhead of one forward (engine-typical).
  * decode_fixed_ms 5.3: every step streams the 16.1 GB of weights at the measured ~3,000 GB/s.
  * decode_per_context_token_ms 9.2e-5: the KV of one context token is 128 KiB, gathered from
    paged blocks at the measured 1,423 GB/s.
  * decode_per_seq_ms 0.02: per-sequence sampling and bookkeeping (engine-typical).
  * chunk_tokens 8192: the chunked-prefill budget vLLM and SGLang use on an H100; running decodes
    ride along each prefill chunk, so a chunk costs one decode step more (decodes_ride_prefill;
    kvmesh's own engine runs a prompt in one step and its decodes wait through it).
  * prefill_batch_tokens 0: one prefill a step. kvmesh's engine admits every waiting request
    whose new tokens fit `max_num_batched_tokens` (8192) into one prefill step
    (`workers/engine/scheduler.py`): one forward, so the fixed part and the step's host time
    are paid once for all of them.
  * service_latency_ms 0: compute alone. Measured through kvmesh on an H100 (gRPC + Ray, local
    hit of 7.5K of 8K cached): 15-17 ms over the runner's forward (`docs/benchmarks.md`).
  * host_between_steps_per_seq_ms 0: the engine thread's work between two steps under load
    (`workers/engine_thread.py`'s `_iterate`: the step's outputs handed over, its KV events and
    request notes published, the requests that came meanwhile taken in), beyond what the idle
    calibration's step holds; measured by the workers' counters (`engine_steps`'
    `host_ms_per_step`, ~0.41 ms a sequence a step on the 8B runs).
  * host_step_fixed_ms, host_step_per_seq_ms, delivery_fixed_ms, delivery_per_stream_ms 0: the
    GPU's time alone, outputs at the client the moment the worker makes them. Fitted from the
    four-depth measurement on an H100 by `benchmarks/sim_cost_fit.py` (steps 0.64 ms + 0.038 ms
    per sequence over the runner's forward; delivery 0.78 ms per token per stream in flight).
  * transfer_per_token_ms 0.0024: "moving its KV over PCIe 2.4 us" per token, measured (55 GB/s
    pinned host<->device); a 400 Gb/s NIC moves it at about the same rate. transfer_fixed_ms 1.0:
    one round trip of control messages plus registration (engine-typical).
  * stream_end_ms 0: a stream ends with its last token. Measured in a deployment by
    `benchmarks/deployment_calibration.py` (`coordinator/sim/calibration.py` derives it).

Override any of them with `--cost-model FILE.json` (a JSON object of these field names) or with
`--cost FIELD=VALUE`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.coordinator.routing.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class SimCostModel:
    """Compute times of one simulated worker (see the module docstring for the provenance)."""

    prefill_fixed_ms: float = 2.0
    """Per-forward overhead of a prefill."""
    prefill_per_token_ms: float = 0.020
    """Linear prefill cost per uncached prompt token."""
    attention_per_token_pair_ms: float = 8.8e-7
    """Quadratic term: cost per (new token, attended token) pair, all layers."""
    cached_attention_factor: float = 1.0
    """What a pair whose key was cached before the chunk (a hit's prefix) costs, in fresh pairs:
    the cached-prefix kernel's speed against fresh attention's (1: the same)."""
    decode_fixed_ms: float = 5.3
    """Fixed cost of one decode step (reading the weights)."""
    decode_per_seq_ms: float = 0.02
    """Extra decode-step cost per running sequence."""
    decode_per_context_token_ms: float = 9.2e-5
    """Extra decode-step cost per token of KV the batch attends to."""
    chunk_tokens: int = 8192
    """Chunked-prefill budget: a prefill of n new tokens runs in ceil(n / chunk_tokens) steps."""
    prefill_batch_tokens: int = 0
    """New tokens one prefill step may carry over several waiting requests, as kvmesh's engine
    does (its scheduler's `max_num_batched_tokens`, 8192): the head of the queue always runs,
    however long; the requests behind it join its last step in arrival order while their new
    tokens fit what is left and their KV is ready (no pull, no host copy). 0: one prefill a step.
    Needs `decodes_ride_prefill` false (kvmesh's engine's step shape)."""
    decodes_ride_prefill: bool = True
    """Each prefill chunk's step carries the running decodes, each of which gets its token (vLLM's
    and SGLang's chunked prefill). False: a prefill step runs alone and the decodes wait for it
    (kvmesh's engine: prefill first, then one batched decode step)."""
    transfer_fixed_ms: float = 1.0
    """Set-up of one peer-to-peer KV pull (request, registration, completion)."""
    transfer_per_token_ms: float = 0.0024
    """Moving one token's KV (128 KiB) between workers."""
    service_latency_ms: float = 0.0
    """What a request's first (and last) token spends outside the worker's compute: the client,
    gRPC, the coordinator, Ray's actor call and stream. It delays TTFT and end-to-end time but
    takes no worker time, so it changes no routing; 0 models the compute alone."""
    host_step_fixed_ms: float = 0.0
    """The engine's host work of every step, prefill or decode (scheduling, the step's outputs,
    its KV events): worker time, so it delays the next step."""
    host_step_per_seq_ms: float = 0.0
    """... and per sequence in the step (its sampling, its output, its blocks)."""
    host_between_steps_per_seq_ms: float = 0.0
    """The engine thread's work between a step and the next, per sequence the step carried, as
    a loaded engine does it and the idle calibration does not see: the outputs handed to the
    streams, the step's KV events and request notes published (a Redis round trip the next step
    waits behind), the requests that arrived meanwhile taken in (`engine_thread.py`, `_iterate`).
    Worker time, like `host_step_per_seq_ms`, and added to it; the router's model leaves it out
    (a coordinator calibrated on an idle fleet does not hold it). 0: not charged."""
    delivery_fixed_ms: float = 0.0
    """Each token's way from the worker to the client, apart from the streams it shares the way
    with. Delays the client's token, takes no worker time."""
    delivery_per_stream_ms: float = 0.0
    """... and per stream the coordinator carries at once: the coordinator's (and gRPC's) work
    per token, shared by every stream, so n streams deliver a token each every
    delivery_ms(n)."""
    stream_end_ms: float = 0.0
    """What a stream's end costs the client beyond its last token's step and delivery (the last
    output's way, the stream's close): it lengthens the request's end-to-end time and its last
    gap, so its TPOT, and takes no worker time."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.prefill_batch_tokens and self.decodes_ride_prefill:
            raise ValueError(
                f"prefill_batch_tokens {self.prefill_batch_tokens} needs decodes_ride_prefill "
                "false: kvmesh's engine batches prefills in steps that carry no decodes"
            )

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, str | int | float], base: SimCostModel | None = None
    ) -> SimCostModel:
        """`base` (default: the defaults) with the named fields replaced; unknown names raise."""
        known = {f.name: f.type for f in fields(cls)}
        converted: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in known:
                raise ValueError(f"unknown cost-model field {key!r}; fields: {', '.join(known)}")
            if known[key] in (bool, "bool"):
                converted[key] = _flag(key, raw)
                continue
            kind = int if known[key] in (int, "int") else float
            try:
                converted[key] = kind(raw)
            except (TypeError, ValueError):
                raise ValueError(f"cost-model {key} must be a number, got {raw!r}") from None
        return replace(base or cls(), **converted)

    @classmethod
    def from_json(cls, path: str | Path, base: SimCostModel | None = None) -> SimCostModel:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a JSON object of cost-model fields")
        return cls.from_mapping(values, base)

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def prefill_ms(self, num_new_tokens: int, num_cached_tokens: int) -> float:
        if num_new_tokens <= 0:
            return 0.0
        pairs = num_new_tokens * (
            num_cached_tokens * self.cached_attention_factor + num_new_tokens / 2
        )
        return (
            self.prefill_fixed_ms
            + num_new_tokens * self.prefill_per_token_ms
            + pairs * self.attention_per_token_pair_ms
        )

    def num_chunks(self, num_new_tokens: int) -> int:
        return max(1, -(-num_new_tokens // self.chunk_tokens))

    def decode_step_ms(self, batch_size: int, context_tokens: int) -> float:
        """One decode step of `batch_size` sequences reading `context_tokens` of KV, host work
        included (0 for no batch: no step runs)."""
        if batch_size <= 0:
            return 0.0
        return (
            self.decode_fixed_ms
            + batch_size * self.decode_per_seq_ms
            + context_tokens * self.decode_per_context_token_ms
            + self.host_step_ms(batch_size)
        )

    def chunk_step_ms(
        self, chunk_len: int, num_done_tokens: int, batch_size: int, context_tokens: int
    ) -> float:
        """A step that prefills `chunk_len` prompt tokens behind `num_done_tokens` and carries a
        decode batch: the chunk, the batch's decode step, and the prefilling sequence's own host
        work (the step's fixed part too when no batch rides along). Without
        `decodes_ride_prefill` the batch does not ride: the step is the chunk's alone."""
        if not self.decodes_ride_prefill:
            batch_size, context_tokens = 0, 0
        own_host_ms = (self.host_step_per_seq_ms + self.host_between_steps_per_seq_ms) + (
            0.0 if batch_size > 0 else self.host_step_fixed_ms
        )
        return (
            self.prefill_ms(chunk_len, num_done_tokens)
            + self.decode_step_ms(batch_size, context_tokens)
            + own_host_ms
        )

    def prefill_batch_step_ms(self, chunks: Sequence[tuple[int, int]]) -> float:
        """A prefill step over several sequences' chunks, each (new tokens, tokens before them),
        no decodes in it: one forward, so its fixed part and the step's fixed host time are
        paid once, each chunk's tokens and attention and host time per sequence each time.
        One chunk costs what `chunk_step_ms(new, done, 0, 0)` does."""
        if not chunks:
            raise ValueError("a prefill step needs at least one chunk")
        for new, done in chunks:
            if new < 1 or done < 0:
                raise ValueError(f"a chunk needs >= 1 new token and >= 0 before it: {new}, {done}")
        own = sum(self.prefill_ms(new, done) - self.prefill_fixed_ms for new, done in chunks)
        return self.prefill_fixed_ms + own + self.host_step_ms(len(chunks))

    def host_step_ms(self, num_seqs: int) -> float:
        """The engine's host work in a step over `num_seqs` sequences (0 for an empty step)."""
        if num_seqs <= 0:
            return 0.0
        per_seq = self.host_step_per_seq_ms + self.host_between_steps_per_seq_ms
        return self.host_step_fixed_ms + num_seqs * per_seq

    def delivery_ms(self, num_streams: float) -> float:
        """How often each of `num_streams` streams sharing the way to the client gets a token
        through it (also the least time a token spends on it). `num_streams` may be a mean
        over time, hence a float."""
        if num_streams <= 0:
            return 0.0
        return self.delivery_fixed_ms + num_streams * self.delivery_per_stream_ms

    def transfer_ms(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.transfer_fixed_ms + num_tokens * self.transfer_per_token_ms

    def transfer_ms_array(self, num_tokens: np.ndarray) -> np.ndarray:
        """`transfer_ms` of each row (the same operations, so the same values)."""
        tokens = np.asarray(num_tokens, dtype=np.int64)
        ms = self.transfer_fixed_ms + tokens * self.transfer_per_token_ms
        if tokens.ndim == 1 and len(tokens) and tokens[tokens.argmin()] > 0:
            return ms  # every row moves tokens (the router's case)
        return np.where(tokens > 0, ms, 0.0)

    def router_cost_model(self, typical_context_tokens: int = 4096) -> CostModel:
        """The router's (coarser) model of the same hardware: what a calibrated coordinator
        would hold. Its decode cost per sequence folds in a typical context length, and its step
        the engine's host time (a calibrated coordinator measures whole steps)."""
        per_seq = self.decode_per_seq_ms + typical_context_tokens * self.decode_per_context_token_ms
        per_seq += self.host_step_per_seq_ms
        return CostModel(
            prefill_fixed_ms=self.prefill_fixed_ms,
            prefill_per_token_ms=self.prefill_per_token_ms,
            attention_per_token_pair_ms=self.attention_per_token_pair_ms,
            decode_fixed_ms=self.decode_fixed_ms + self.host_step_fixed_ms,
            decode_per_seq_ms=per_seq,
            decode_per_kv_token_ms=self.decode_per_context_token_ms,
        )


def _flag(key: str, raw: object) -> bool:
    """A yes/no field from JSON (true / false) or a command line (true, false, 1, 0)."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int | float) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0"):
        return raw.lower() in ("true", "1")
    raise ValueError(f"cost-model {key} must be true or false, got {raw!r}")
