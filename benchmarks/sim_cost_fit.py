"""The simulator's step and delivery terms, fitted from `service_path.py`'s four depths, or
derived from the deployment an end-to-end run judges (`--calibration`).

`--calibration REPORT` takes a `gpu_e2e.py --calibrate` report instead and derives the cost model
from its `calibration` block, measured in that run's own deployment before its sweep; the
derivation is `kvmesh.coordinator.sim.calibration`'s docstring. `--base` gives what the block
does not measure: the attention rate, the decode step's GPU terms that split the measured step
from the engine's host time (`docs/data/sim_cost_h100_service_path.json`: the runner's, on an
H100), the transfer terms. `sim_vs_real.py --cost-model-from-report` does the same from the report
it compares, so the device run's JSON alone gives the calibrated comparison.

`service_path.py` serves the same requests at four depths on one GPU: the runner's forward, the
engine (`Worker.step()` in-process), the worker's Ray actor, and the whole service (gRPC, the
coordinator, the actor, a client in its own process). Its decode rows (a batch of 1 and of B
sequences of a P-token prompt, T tokens each) and its local hit (an 8K prompt, 7.5K cached) give:

  * the decode step's GPU time, from the runner's ms per step at batch 1 and B: keeping
    `decode_per_seq_ms` at its default, two equations in `decode_fixed_ms` and
    `decode_per_context_token_ms` (the batch reads B x (P + T / 2) tokens of KV on average);
  * the engine's host time per step, from the actor's ms per token over the runner's ms per step
    (the engine thread as deployed, beside the actor's output stream), a line through batch 1
    and B: `host_step_fixed_ms + seqs * host_step_per_seq_ms`;
  * the delivery cost, from the service's ms per token: where the service is slower than the
    actor (batch B), its way to the client sets the pace, B streams a token each every
    `delivery_ms(B)`; at batch 1 the service keeps up with the worker, which only bounds
    delivery_ms(1) from above, so `delivery_fixed_ms` is 0 and
    `delivery_per_stream_ms = service ms per token at B / B`;
  * `prefill_fixed_ms`, from the runner's forward of the local hit (N new tokens behind C
    cached) less its per-token and attention terms (from `--base`): a forward reads every
    weight, however few its tokens, so a short prefill costs about what a decode step does;
  * `service_latency_ms`, what a local hit's first token spends outside the worker's step and
    its delivery: the service's TTFT - the runner's forward - host_step_ms(1) - delivery_ms(1).

The per-token prefill terms are not measured here: they come from `--base` (default:
`docs/data/sim_cost_h100_measured.json`, whose 0.026 ms a token is the runner's cold 8K prefill
with torch's element-wise ops, 244-250 ms, before the fused kernels). `--runner` replaces
`prefill_per_token_ms` with what a `gpu_runner.py` report gives, from its cold prefill (P
tokens) and its cached forward (N new behind C cached) on the runner's default path, the same
run: the two forwards differ by (P - N) tokens and by their attention (`--base`'s pair rate), so
`prefill_per_token_ms = (cold - cached - pairs(P, 0) x a + pairs(N, C) x a) / (P - N)`.

Three fields describe kvmesh's engine rather than a measurement: its prefill steps carry no decodes
(`decodes_ride_prefill` false: prefill first, then a batched decode step), a prompt runs in
one step however long (`chunk_tokens` 131072, more than any prompt of the runs compared), and
one prefill step takes every waiting request whose new tokens fit the scheduler's
`max_num_batched_tokens` (`prefill_batch_tokens` 8192, `workers/engine/scheduler.py`).

Usage: python benchmarks/sim_cost_fit.py docs/data/service_path_shared_stream_h100.json \
           [more service_path JSON ...] [--base FILE] \
           [--runner docs/data/gpu_runner_final_h100.json] \
           [--out docs/data/sim_cost_h100_service_path.json]
       python benchmarks/sim_cost_fit.py --calibration E2E.json \
           --base docs/data/sim_cost_h100_service_path.json [--out FILE]
The first file is the one written to --out; every file's fit is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvmesh.coordinator.sim.calibration import (
    CalibratedFit,
    DeploymentCalibration,
    calibrated_fields,
)
from kvmesh.coordinator.sim.cost_model import SimCostModel

BASE = Path("docs/data/sim_cost_h100_measured.json")
ENGINE: dict[str, bool | int] = {
    "decodes_ride_prefill": False,
    "chunk_tokens": 131072,
    "prefill_batch_tokens": 8192,
}
"""kvmesh's engine's step shape (see the module docstring)."""


def fit(report: dict[str, Any], base: SimCostModel) -> dict[str, float]:
    """Cost-model fields from one `service_path.py` report (see the module docstring)."""
    args = report["args"]
    batches = sorted(int(b) for b in args["batches"])
    if len(batches) < 2 or batches[0] != 1:
        raise ValueError(f"need decode at batch 1 and a larger batch, got {batches}")
    b = batches[-1]
    engine, actor = report["engine"], report["actor"]
    runner_1, runner_b = engine["decode_b1"]["runner_ms"], engine[f"decode_b{b}"]["runner_ms"]
    actor_1, actor_b = actor["decode_b1"]["actor_tpot_ms"], actor[f"decode_b{b}"]["actor_tpot_ms"]
    service_b = actor[f"decode_b{b}"]["service_tpot_ms"]
    per_seq = base.decode_per_seq_ms
    context_per_seq = args["decode_prompt"] + args["decode_tokens"] / 2
    per_context = (runner_b - runner_1 - (b - 1) * per_seq) / ((b - 1) * context_per_seq)
    decode_fixed = runner_1 - per_seq - context_per_seq * per_context
    host_1, host_b = actor_1 - runner_1, actor_b - runner_b
    host_per_seq = (host_b - host_1) / (b - 1)
    host_fixed = host_1 - host_per_seq
    delivery_per_stream = service_b / b if service_b > actor_b else 0.0
    hit_runner = engine["local_hit"]["runner_ms"]
    new_tokens, cached = args["prompt"] - args["prefix"], args["prefix"]
    prefill_fixed = hit_runner - base.prefill_ms(new_tokens, cached) + base.prefill_fixed_ms
    hit = actor["local_hit"]["service_ms"] - hit_runner
    service_latency = hit - host_1 - delivery_per_stream
    fields: dict[str, float] = {
        "prefill_fixed_ms": prefill_fixed,
        "decode_fixed_ms": decode_fixed,
        "decode_per_context_token_ms": per_context,
        "host_step_fixed_ms": host_fixed,
        "host_step_per_seq_ms": host_per_seq,
        "delivery_fixed_ms": 0.0,
        "delivery_per_stream_ms": delivery_per_stream,
        "service_latency_ms": service_latency,
    }
    bad = {k: v for k, v in fields.items() if not v >= 0}
    if bad:
        raise ValueError(f"the measurement gives negative terms: {bad}")
    return fields


def runner_prefill_per_token_ms(report: dict[str, Any], base: SimCostModel) -> float:
    """The runner's prefill rate per token (see the module docstring) from a `gpu_runner.py`
    report: its cold prefill and its cached forward on the default path."""
    prefill, shape = report["prefill"], report["cached_attention"]
    new_tokens, cached = int(shape["query_len"]), int(shape["prefix_len"])
    prompt = new_tokens + cached
    cold_ms, cached_ms = prefill["cold_ms"], prefill["cached_ms"][prefill["runner_default"]]
    a = base.attention_per_token_pair_ms
    attention_gap = (prompt * prompt / 2 - new_tokens * (cached + new_tokens / 2)) * a
    per_token = (cold_ms - cached_ms - attention_gap) / (prompt - new_tokens)
    if not per_token > 0:
        raise ValueError(f"the runner's forwards give a prefill rate of {per_token} ms a token")
    return per_token


def from_calibration(
    report: dict[str, Any], base_fields: dict[str, Any]
) -> tuple[dict[str, Any], CalibratedFit]:
    """The cost model (`base_fields` with the derived fields and kvmesh's engine's step shape
    over them) from a `gpu_e2e.py --calibrate` report, and the fit it came from."""
    block = report.get("calibration")
    if not isinstance(block, dict):
        raise ValueError("the report has no calibration block (run gpu_e2e.py with --calibrate)")
    if "error" in block:
        raise ValueError(f"the report's calibration failed: {block['error']}")
    calibration = DeploymentCalibration.from_mapping(block)
    fitted = calibrated_fields(calibration, SimCostModel.from_mapping(base_fields))
    merged = {**base_fields, **rounded(fitted.fields), **ENGINE}
    SimCostModel.from_mapping(merged)  # every field known and >= 0
    return merged, fitted


def print_calibrated(path: Path, fitted: CalibratedFit) -> None:
    print(f"{path} (calibration):")
    for key, value in rounded(fitted.fields).items():
        print(f"  {key:30s} {value:g}")
    for key, value in fitted.checks.items():
        print(f"  check {key:36s} {value:.2f}")
    for note in fitted.notes:
        print(f"  note: {note}")


def rounded(fields: dict[str, float]) -> dict[str, float]:
    """Three significant figures: the measurement's precision, at most."""
    return {k: float(f"{v:.3g}") for k, v in fields.items()}


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("reports", type=Path, nargs="*", help="service_path.py JSON reports")
    parser.add_argument(
        "--calibration",
        type=Path,
        help="gpu_e2e.py --calibrate report: the cost model from its calibration block",
    )
    parser.add_argument("--base", type=Path, default=BASE, help="cost-model JSON the fit extends")
    parser.add_argument(
        "--runner", type=Path, help="gpu_runner.py report: the prefill rate per token from it"
    )
    parser.add_argument("--out", type=Path, help="write the first report's cost model here")
    args = parser.parse_args()
    if bool(args.reports) == bool(args.calibration):
        parser.error("give service_path.py reports or --calibration, one of the two")
    try:
        base_fields = json.loads(args.base.read_text())
        if args.calibration:
            merged, fitted = from_calibration(json.loads(args.calibration.read_text()), base_fields)
            print_calibrated(args.calibration, fitted)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(merged, indent=2) + "\n")
            return
        base = SimCostModel.from_mapping(base_fields)
        if args.runner:
            per_token = runner_prefill_per_token_ms(json.loads(args.runner.read_text()), base)
            base_fields["prefill_per_token_ms"] = rounded({"p": per_token})["p"]
            base = SimCostModel.from_mapping(base_fields)
            print(f"{args.runner}: prefill_per_token_ms {base.prefill_per_token_ms:g}")
        fits = [rounded(fit(json.loads(p.read_text()), base)) for p in args.reports]
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(f"sim_cost_fit: {exc!r}")
    for path, fields in zip(args.reports, fits, strict=True):
        print(f"{path}:")
        for key, value in fields.items():
            print(f"  {key:30s} {value:g}")
    if args.out:
        merged = {**base_fields, **fits[0], **ENGINE}
        SimCostModel.from_mapping(merged)  # every field known and >= 0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    main()
