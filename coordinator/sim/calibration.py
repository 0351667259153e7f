"""A deployment's own step figures, and the simulator's cost model derived from them.

`benchmarks/deployment_calibration.py` measures, in the deployment an end-to-end run judges (its
workers, its coordinator, its Redis, its client process; before the sweep), what the simulator's
step terms mean. `DeploymentCalibration` holds those figures (the `calibration` block of
`gpu_e2e.py --calibrate`'s report) and `calibrated_fields` derives the cost model from them, so a
comparison with that run is calibrated by measurement, not fitted to the run it judges.

The prompts are the workload's: a hit is N new tokens (its question) behind C cached (its system
prompt), a cold prompt N + C tokens, each served alone on an idle worker. The worker reports, for
each, `prefill_ms` (its first prefill step to its first token) and `queued_ms` (accepted to that
step); the client times its TTFT. pairs(n, c) = n x (c + n / 2), a = `base`'s
attention_per_token_pair_ms.

  * prefill_per_token_ms = (cold.prefill - hit.prefill - a x (pairs(N + C, 0) - pairs(N, C))) / C
    (the two forwards differ by C tokens and by their attention; the step's fixed parts cancel).
  * Where hits batched in one prefill step were timed (`batched`: b hits queued on a worker
    behind a cold prompt, so that one step admits them all, as a loaded worker batches the hits
    waiting behind a long prefill) at two or more b: the step's least-squares slope in b, less
    host_step_per_seq_ms, is what one more hit costs the step,
        N x prefill_per_token_ms + a x (N x C x f + N^2 / 2),  f = cached_attention_factor
    (pairs over cached keys counted f times: the cached-prefix kernel does not run at fresh
    attention's speed). Added to the cold - hit difference it gives
        (cold.prefill - hit.prefill) + slope = (N + C) x prefill_per_token_ms + a x pairs(N + C, 0),
    so the rate per token from both, then f; the hit alone still sets prefill_fixed_ms (below,
    with f). Without them the rate comes from the first bullet and f is `base`'s.
  * The decode step S(b): the worker's own step at b sequences (the time per token of its
    output stream, read at the coordinator's process, every worker decoding b at once), and its
    least-squares line S(b) = s0 + s1 x b at the run's context per sequence K. `base`'s GPU
    terms are kept where the line is above them and the rest is the engine's host time:
        host_step_fixed_ms   = s0 - decode_fixed_ms
        host_step_per_seq_ms = s1 - (decode_per_seq_ms + K x decode_per_context_token_ms)
    Where the line is below a GPU term, that term is lowered to the line (decode_fixed_ms = s0;
    for the slope decode_per_context_token_ms first, then decode_per_seq_ms) and the host term is
    0. The worker does not report its host time apart, so the split rests on `base`; the step the
    simulator prices, S(b) at K, is the measured one either way.
  * prefill_fixed_ms = hit.prefill - host_step_ms(1) - N x prefill_per_token_ms - pairs(N, C) x a:
    the simulator's step for the hit alone (`chunk_step_ms(N, C, 0, 0)`) is what the worker
    measured.
  * delivery_per_stream_ms (delivery_fixed_ms 0): where the client's gap between tokens is
    longer than the worker's step by more than `PACED_MARGIN` (the two are means of the same
    tokens: a gap a few percent over the step is timing noise, and a batch counted as paced
    by it prices every token's way as gap / n, e.g. 4.3 ms a stream from an 8.55 ms gap at
    two streams against an 8.45 ms step), the coordinator's way to the client sets the pace,
    n streams (b x workers) a token each every delivery_ms(n); least squares through 0 over
    those batches, 0 where the client kept up at every batch (the simulator's first and last
    tokens then spend no time on the way, which the next two terms absorb).
  * service_latency_ms = hit.client_ttft - hit.prefill - delivery_ms(1): the worker's queue at
    idle (its `queued_ms`), the actor call, the coordinator, gRPC and the client, all that a first
    token spends beside the worker's step and its delivery.
  * stream_end_ms = end - mid, a short stream's (the workload's answer, O tokens) at the client:
    `end` from its token O - 1 to the stream's end, `mid` its mean gap between tokens 1 and O - 1.
    TPOT is (end of stream - first token) / (O - 1), so an end that costs more than a step reads
    as (end - mid) / (O - 1) more a token.

Checks (not fitted, printed beside the fields): the cold prompt's client TTFT as the derived model
prices it, against the measured one; each batch's step against the line's; each batch's client gap
against max(step, delivery_ms(n)).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvmesh.coordinator.sim.cost_model import SimCostModel

PACED_MARGIN = 0.05
"""How much longer than the worker's step the client's gap must be for a batch to count as paced
by the way to the client (`delivery_per_stream_ms`)."""


@dataclass(frozen=True, slots=True)
class PromptTiming:
    """One prompt shape served alone on an idle worker: medians over trials and workers."""

    new_tokens: int
    """Tokens the worker computes."""
    cached_tokens: int
    """Tokens it reused (the prefix it held; 0 for a cold prompt), as the worker reported."""
    client_ttft_ms: float
    """At the client: sending the request to the first token."""
    actor_ttft_ms: float
    """At the coordinator's process, calling the worker directly: to its first output."""
    worker_queued_ms: float
    """The worker's own: accepted to the first step that ran part of the prompt."""
    worker_prefill_ms: float
    """The worker's own: that step to the first token."""


@dataclass(frozen=True, slots=True)
class DecodeTiming:
    """`batch` sequences decoding on every worker at once."""

    batch: int
    """Sequences per worker."""
    num_streams: int
    """Streams the coordinator carried at once (batch x workers)."""
    context_tokens_per_seq: float
    """KV tokens each sequence read per step, on average over the run."""
    worker_step_ms: float
    """Time per token of the worker's output stream, read at the coordinator's process."""
    client_gap_ms: float
    """Time per token at the client, between tokens (the stream's end left out)."""
    client_tpot_ms: float
    """(end of stream - first token) / (tokens - 1) at the client, as the sweep reports TPOT."""


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """A short stream (the workload's answer) on an idle worker: where its time per token goes."""

    output_len: int
    client_mid_gap_ms: float
    """Mean gap between tokens 1 and output_len - 1, at the client."""
    client_end_gap_ms: float
    """From token output_len - 1 to the end of the stream, at the client."""
    actor_mid_gap_ms: float
    """The same, at the coordinator's process calling the worker directly."""
    actor_end_gap_ms: float


@dataclass(frozen=True, slots=True)
class BatchedHits:
    """`batch` hits queued on one worker behind a cold prompt, so that one prefill step admits
    them all (as a loaded worker batches the hits waiting behind a long prefill)."""

    batch: int
    worker_prefill_ms: float
    """Their step to their first token, as the worker reported it: median over the hits,
    trials and workers."""


@dataclass(frozen=True, slots=True)
class DeploymentCalibration:
    """The figures `calibrated_fields` needs, as one deployment measured them."""

    num_workers: int
    hit: PromptTiming
    cold: PromptTiming
    decode: tuple[DecodeTiming, ...]
    stream_end: StreamEnd
    batched: tuple[BatchedHits, ...] = ()
    """Prefill steps of several hits (none in reports from before they were timed)."""

    def __post_init__(self) -> None:
        if self.hit.cached_tokens < 1 or self.cold.cached_tokens:
            raise ValueError(
                f"a hit reuses a prefix and a cold prompt none: got {self.hit.cached_tokens} "
                f"and {self.cold.cached_tokens} cached tokens"
            )
        if self.cold.new_tokens <= self.hit.new_tokens:
            raise ValueError(
                f"the cold prompt ({self.cold.new_tokens} tokens) must compute more than the hit "
                f"({self.hit.new_tokens})"
            )
        if len({d.batch for d in self.decode}) < 2:
            raise ValueError(
                f"the step's line needs two batch sizes, got {[d.batch for d in self.decode]}"
            )
        if self.stream_end.output_len < 3:
            raise ValueError(f"a stream's end needs >= 3 tokens, got {self.stream_end.output_len}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DeploymentCalibration:
        """From the report's `calibration` block (`as_dict`'s shape; extra keys are ignored)."""
        try:
            return cls(
                num_workers=int(values["num_workers"]),
                hit=_known(PromptTiming, values["hit"]),
                cold=_known(PromptTiming, values["cold"]),
                decode=tuple(_known(DecodeTiming, d) for d in values["decode"]),
                stream_end=_known(StreamEnd, values["stream_end"]),
                batched=tuple(_known(BatchedHits, b) for b in values.get("batched", ())),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a calibration block: missing or bad {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class CalibratedFit:
    """The derived cost-model fields and the figures that check them."""

    fields: dict[str, float]
    checks: dict[str, float]
    """Measured and derived figures the fit did not use (see the module docstring)."""
    notes: tuple[str, ...]
    """Terms lowered to the measurement (a GPU term of `base` above the measured step)."""


def pairs(new: float, cached: float, cached_factor: float = 1.0) -> float:
    """(query, key) pairs of a causal prefill of `new` tokens behind `cached`, those over cached
    keys counted `cached_factor` times (`SimCostModel.cached_attention_factor`)."""
    return new * (cached * cached_factor + new / 2)


def line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs (two distinct xs at least)."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return mean_y - slope * mean_x, slope


def batch_line(batched: Sequence[BatchedHits]) -> tuple[float, float]:
    """A prefill step of hits against their number."""
    return line([float(b.batch) for b in batched], [b.worker_prefill_ms for b in batched])


def step_line(decode: Sequence[DecodeTiming]) -> tuple[float, float]:
    """The worker's decode step against its batch."""
    return line([float(d.batch) for d in decode], [d.worker_step_ms for d in decode])


def calibrated_fields(calibration: DeploymentCalibration, base: SimCostModel) -> CalibratedFit:
    """Cost-model fields from one deployment's calibration (see the module docstring)."""
    hit, notes = calibration.hit, []
    a = base.attention_per_token_pair_ms
    s0, s1 = step_line(calibration.decode)
    context = sum(d.context_tokens_per_seq for d in calibration.decode) / len(calibration.decode)
    decode_fixed, host_fixed = s0 - base.decode_fixed_ms, 0.0
    if decode_fixed >= 0:
        decode_fixed, host_fixed = base.decode_fixed_ms, decode_fixed
    else:
        decode_fixed = max(0.0, s0)
        notes.append(f"decode_fixed_ms lowered from {base.decode_fixed_ms:g} to the step's {s0:g}")
    per_seq, per_context = base.decode_per_seq_ms, base.decode_per_context_token_ms
    host_per_seq = s1 - per_seq - context * per_context
    if host_per_seq < 0:
        per_context = max(0.0, (s1 - per_seq) / context)
        per_seq = min(per_seq, max(0.0, s1))
        host_per_seq = 0.0
        notes.append(
            f"the step's slope {s1:g} ms a sequence is under base's GPU terms: "
            f"decode_per_context_token_ms {per_context:g}, decode_per_seq_ms {per_seq:g}"
        )
    host_1 = host_fixed + host_per_seq
    per_token, factor = _prefill_terms(calibration, base, host_per_seq, notes)
    hit_pairs = pairs(hit.new_tokens, hit.cached_tokens, factor)
    hit_tokens_ms = hit.new_tokens * per_token + hit_pairs * a
    prefill_fixed = hit.worker_prefill_ms - host_1 - hit_tokens_ms
    if prefill_fixed < 0:
        notes.append(f"prefill_fixed_ms {prefill_fixed:g} raised to 0")
        prefill_fixed = 0.0
    paced = [
        d for d in calibration.decode if d.client_gap_ms > (1 + PACED_MARGIN) * d.worker_step_ms
    ]
    delivery_per_stream = (
        sum(d.num_streams * d.client_gap_ms for d in paced) / sum(d.num_streams**2 for d in paced)
        if paced
        else 0.0
    )
    service_latency = hit.client_ttft_ms - hit.worker_prefill_ms - delivery_per_stream
    if service_latency < 0:
        notes.append(f"service_latency_ms {service_latency:g} raised to 0")
        service_latency = 0.0
    end = calibration.stream_end
    stream_end = max(0.0, end.client_end_gap_ms - end.client_mid_gap_ms)
    derived = {
        "prefill_fixed_ms": prefill_fixed,
        "prefill_per_token_ms": per_token,
        "cached_attention_factor": factor,
        "decode_fixed_ms": decode_fixed,
        "decode_per_seq_ms": per_seq,
        "decode_per_context_token_ms": per_context,
        "host_step_fixed_ms": host_fixed,
        "host_step_per_seq_ms": host_per_seq,
        "delivery_fixed_ms": 0.0,
        "delivery_per_stream_ms": delivery_per_stream,
        "service_latency_ms": service_latency,
        "stream_end_ms": stream_end,
    }
    model = SimCostModel.from_mapping(derived, base)
    return CalibratedFit(derived, _checks(calibration, model), tuple(notes))


def _prefill_terms(
    calibration: DeploymentCalibration, base: SimCostModel, host_per_seq: float, notes: list[str]
) -> tuple[float, float]:
    """(prefill_per_token_ms, cached_attention_factor): from the cold prompt and the hit alone
    with `base`'s factor, or, where hits batched in one step were timed, with the factor that
    prices one more hit in a step as measured (see the module docstring)."""
    hit, cold = calibration.hit, calibration.cold
    a, factor = base.attention_per_token_pair_ms, base.cached_attention_factor
    gap_ms = cold.worker_prefill_ms - hit.worker_prefill_ms
    if len({b.batch for b in calibration.batched}) >= 2:
        slope = batch_line(calibration.batched)[1] - host_per_seq
        per_token = (gap_ms + slope - a * pairs(cold.new_tokens, 0)) / cold.new_tokens
        cached_pairs = hit.new_tokens * hit.cached_tokens
        batched_factor = (slope - hit.new_tokens * per_token - a * pairs(hit.new_tokens, 0)) / (
            a * cached_pairs
        )
        if per_token > 0 and batched_factor >= 0:
            return per_token, batched_factor
        notes.append(
            f"the batched hits' slope ({slope:g} ms a hit) gives a prefill rate of {per_token:g} "
            f"ms a token and a cached-pair factor of {batched_factor:g}: not used (did the hits "
            "queue behind the cold prompt?)"
        )
    computed_gap = cold.new_tokens - hit.new_tokens
    attention_gap = a * (
        pairs(cold.new_tokens, 0) - pairs(hit.new_tokens, hit.cached_tokens, factor)
    )
    per_token = (gap_ms - attention_gap) / computed_gap
    if not per_token > 0:
        raise ValueError(
            f"the cold prompt's prefill ({cold.worker_prefill_ms:.2f} ms) is not longer than the "
            f"hit's ({hit.worker_prefill_ms:.2f} ms) by its {computed_gap} tokens' attention"
        )
    return per_token, factor


def _checks(calibration: DeploymentCalibration, model: SimCostModel) -> dict[str, float]:
    cold = calibration.cold
    cold_ttft = (
        model.chunk_step_ms(cold.new_tokens, 0, 0, 0)
        + model.delivery_ms(1)
        + model.service_latency_ms
    )
    out = {"cold_client_ttft_ms": cold.client_ttft_ms, "cold_client_ttft_ms_derived": cold_ttft}
    for d in calibration.decode:
        context = round(d.batch * d.context_tokens_per_seq)
        step = model.decode_step_ms(d.batch, context)
        out[f"worker_step_ms_b{d.batch}"] = d.worker_step_ms
        out[f"worker_step_ms_b{d.batch}_derived"] = step  # the line's residual
        out[f"client_gap_ms_b{d.batch}"] = d.client_gap_ms
        out[f"client_gap_ms_b{d.batch}_derived"] = max(step, model.delivery_ms(d.num_streams))
    hit = calibration.hit
    for b in calibration.batched:
        chunks = [(hit.new_tokens, hit.cached_tokens)] * b.batch
        out[f"hits_step_ms_b{b.batch}"] = b.worker_prefill_ms
        out[f"hits_step_ms_b{b.batch}_derived"] = model.prefill_batch_step_ms(chunks)
    return out


def _known(kind: Any, values: Mapping[str, Any]) -> Any:
    names = {f.name for f in fields(kind)}
    return kind(**{k: v for k, v in values.items() if k in names})
