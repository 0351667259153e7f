"""The simulator against a real GPU run: the same requests at the same send times, TTFT and TPOT.

`gpu_e2e.py` sends one shared-prefix request stream to a real deployment, one rate after
another (each rate a slice of the stream, caches carried over). This replays exactly those
requests at exactly those send times (each slice starting when the last one's answers were in,
as the real sweep did, estimated from its duration plus the slice's slowest request) through
`kvmesh simulate`'s engine, the same policy, worker count and pool size, and compares TTFT and
TPOT per rate with what the real run measured. The simulator's cost model is Llama-3-8B bf16 on
an H100, the shape and card of the real run; `--cost-model` replaces any of its fields
(`docs/data/sim_cost_h100_service_path.json`: the runner's decode and prefill rates, the engine's
host time per step and the service's delivery per token, fitted by `sim_cost_fit.py`).

Every cell is real / simulated (simulated over real) and a verdict: `ok` when the ratio is within
--tolerance of 1, `no` when not, `-` when the real run has no figure (a rate whose requests all
failed, or one-token answers). A policy the real run did not finish is reported and skipped.
Takes `gpu_e2e.py --json`'s report as it is.

`--cost-model-from-report` derives the cost model from the report's own `calibration` block
(`gpu_e2e.py --calibrate`: measured in the run's deployment before its sweep; the derivation is
`kvmesh.coordinator.sim.calibration`'s docstring, as `sim_cost_fit.py --calibration` prints it),
over `--cost-model`'s fields (which give what the block does not measure).

`--between-steps-from-counters` sets `host_between_steps_per_seq_ms` (the engine thread's work
between steps under load, which the idle calibration does not see) from the report's own
engine counters: every row's `engine_steps`, the time between steps (`host_ms_per_step` x
steps) over the sequences the steps carried (prefill steps: the worker's requests; decode
steps: steps x mean batch), least squares through 0 over every worker of every rate and
policy. A measurement of the engines, not of the TTFT or TPOT compared.

`--reports-on-clock` takes the workers' load reports on ticks of the health interval, as the
live health loop does (`SimConfig.reports_on_clock`), not at the first arrival an interval
after the last report (a decision then reads a report of its own moment).

`--cost FIELD=VALUE` (repeatable) replaces one field over `--cost-model`'s, for what-if runs
(a term changed to see what it would take, not a calibration). The last line counts the cells
within, in all and per policy.

Usage: python benchmarks/sim_vs_real.py docs/data/gpu_e2e_8b_2gpu_h100_pull_calls.json \
           [--cost-model docs/data/sim_cost_h100_service_path.json] [--cost-model-from-report] \
           [--cost FIELD=VALUE ...] [--json FILE] [--tolerance 0.2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from sim_cost_fit import from_calibration, print_calibrated  # type: ignore[import-not-found]

from kvmesh.client.bench import send_times
from kvmesh.client.workloads import (
    SharedPrefixConfig,
    WorkloadRequest,
    parse_overrides,
    shared_prefix,
)
from kvmesh.coordinator.routing.router import POLICIES
from kvmesh.coordinator.sim.cluster_simulation import ClusterSimulation
from kvmesh.coordinator.sim.cost_model import SimCostModel
from kvmesh.coordinator.sim.simulator import SimConfig, prepare_requests

DRAIN_S = 1.0
"""Between slices the real sweep waits for the slowest answer, then sets up the next rate."""


def real_schedule(
    config: dict[str, Any], rows: list[dict[str, Any]]
) -> tuple[list[WorkloadRequest], list[int]]:
    """The real sweep's requests and send times, and the slice (rate index) of each."""
    rates = config["rates"]
    needed = sum(int(r * config["duration_s"] * 1.3) + 8 for r in rates)
    spec = SharedPrefixConfig(
        num_groups=config["groups"],
        users_per_group=-(-needed // config["groups"]),
        system_prompt_len=config["system_len"],
        question_len=config["question_len"],
        output_len=config["output_len"],
        vocab_size=config["vocab_size"],
    )
    requests = shared_prefix(spec, config["seed"])
    out: list[WorkloadRequest] = []
    slices: list[int] = []
    offset, start_s = 0, 0.0
    for i, row in enumerate(rows):
        schedule = send_times(requests[offset:], rates[i], config["duration_s"], config["seed"] + i)
        offset += len(schedule)
        for at_s, request in schedule:
            out.append(replace(request, arrival_ms=(start_s + at_s) * 1e3))
            slices.append(i)
        last_s = schedule[-1][0] if schedule else 0.0
        slowest_s = (row.get("e2e_p99_ms") or 0.0) / 1e3  # 0: a rate whose requests all failed
        start_s += max(config["duration_s"], last_s + slowest_s) + DRAIN_S
    return out, slices


def between_steps_per_seq_ms(report: dict[str, Any]) -> float | None:
    """The engines' time between steps per sequence a step carried, from the rows' counters
    (None when no row has them)."""
    host_ms: list[float] = []
    seqs: list[float] = []
    for rows in report["results"].values():
        for row in rows:
            per_worker = row.get("requests_per_worker", {})
            for worker, e in row.get("engine_steps", {}).items():
                if "host_ms_per_step" not in e or worker not in per_worker:
                    continue
                host_ms.append(e["host_ms_per_step"] * (e["prefill_steps"] + e["decode_steps"]))
                seqs.append(per_worker[worker] + e["decode_steps"] * e["decode_batch"])
    x, y = np.array(seqs, dtype=float), np.array(host_ms, dtype=float)
    if not x.size or not float(x @ x) > 0:
        return None
    return float(x @ y / (x @ x))


def percentile(values: list[float], q: int) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.percentile(finite, q)) if finite else math.nan


KEYS = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


def cell(real: float | None, sim: float, tolerance: float) -> dict[str, Any]:
    """One figure: real, simulated, their ratio and whether it is within the tolerance."""
    if real is None or not real > 0 or math.isnan(sim):
        return {"real": real, "sim": sim, "sim_over_real": None, "within_tolerance": None}
    ratio = sim / real
    return {
        "real": real,
        "sim": sim,
        "sim_over_real": ratio,
        "within_tolerance": abs(ratio - 1.0) <= tolerance,
    }


def compare_policy(
    config: dict[str, Any],
    policy: str,
    rows: list[dict[str, Any]],
    tolerance: float,
    cost: SimCostModel,
    reports_on_clock: bool = False,
) -> list[dict[str, Any]]:
    """Each rate of one policy's real sweep beside the simulator's replay of it."""
    arrivals, slices = real_schedule(config, rows)
    requests = prepare_requests(arrivals, 16)
    sim_config = SimConfig(
        num_workers=config["num_workers"],
        capacity_tokens=config["num_blocks"] * 16,
        seed=config["seed"],
        cost=cost,
        reports_on_clock=reports_on_clock,
    )
    simulation = ClusterSimulation(sim_config, policy, requests)
    simulation.run()
    times = simulation.request_times()
    tokens = simulation.request_tokens()
    per_rate = []
    for i, row in enumerate(rows):
        mine = [t for t, s in zip(times, slices, strict=True) if s == i]
        prompt = sum(r.token_ids.size for r, s in zip(arrivals, slices, strict=True) if s == i)
        reused = sum(c + p for (c, p), s in zip(tokens, slices, strict=True) if s == i)
        sim = {
            "ttft_p50_ms": percentile([t[0] for t in mine], 50),
            "ttft_p90_ms": percentile([t[0] for t in mine], 90),
            "tpot_p50_ms": percentile([t[1] for t in mine], 50),
            "tpot_p90_ms": percentile([t[1] for t in mine], 90),
        }
        entry: dict[str, Any] = {
            "rate_rps": row["rate_rps"],
            "num_requests": len(mine),
            "num_requests_real": row.get("num_requests"),
            "num_failed_real": row.get("num_failed", 0),
            "reuse": {  # (cached + pulled) / prompt tokens: where each fleet put the prompts
                "real": row.get("hit_rate", 0.0) + row.get("pulled_rate", 0.0),
                "sim": reused / prompt if prompt else 0.0,
            },
        }
        for key, value in sim.items():
            entry[key] = cell(row.get(key), value, tolerance)
        verdicts = [entry[k]["within_tolerance"] for k in sim]
        entry["within_tolerance"] = all(v is True for v in verdicts)
        per_rate.append(entry)
    return per_rate


def compare(
    report: dict[str, Any],
    tolerance: float,
    cost: SimCostModel | None = None,
    reports_on_clock: bool = False,
) -> dict[str, Any]:
    """Per policy, per rate: real and simulated TTFT and TPOT percentiles (policies the real
    run has no rows for, or the simulator does not know, are left out with a note)."""
    config = report["config"]
    out: dict[str, Any] = {}
    for policy, rows in report["results"].items():
        if not rows:
            print(f"# {policy}: no rates in the real run, skipped", file=sys.stderr)
            continue
        if policy not in POLICIES:
            print(f"# {policy}: not a simulated policy, skipped", file=sys.stderr)
            continue
        out[policy] = compare_policy(
            config, policy, rows, tolerance, cost or SimCostModel(), reports_on_clock
        )
    for policy, error in report.get("errors", {}).items():
        print(
            f"# {policy}: the real run failed ({error}); its finished rates are above",
            file=sys.stderr,
        )
    return out


def _cell_text(c: dict[str, Any]) -> str:
    real = "-" if c["real"] is None else f"{c['real']:.1f}"
    if c["sim_over_real"] is None:
        return f"{real:>8} / {c['sim']:8.1f} (   -   )"
    verdict = "ok" if c["within_tolerance"] else "no"
    return f"{real:>8} / {c['sim']:8.1f} ({c['sim_over_real']:4.2f} {verdict})"


def cells_within(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(cells within the tolerance, cells with a verdict) over one policy's rates."""
    verdicts = [r[k]["within_tolerance"] for r in rows for k in KEYS]
    return sum(v is True for v in verdicts), sum(v is not None for v in verdicts)


def print_table(result: dict[str, Any], tolerance: float = 0.2) -> None:
    print(
        "policy        rate      n  "
        + "  ".join(f"{k:>29}" for k in KEYS)
        + "  all  reuse real / sim"
    )
    cells = within = 0
    for policy, rows in result.items():
        for r in rows:
            n = f"{r['num_requests']}"
            if r.get("num_requests_real") not in (None, r["num_requests"]):
                n += f"!{r['num_requests_real']}"  # the replay does not match the real slice
            print(
                f"{policy:12s} {r['rate_rps']:5.0f} {n:>6}  "
                + "  ".join(_cell_text(r[k]) for k in KEYS)
                + f"  {'ok' if r['within_tolerance'] else 'no':>3}"
                + f"  {r['reuse']['real']:5.0%} / {r['reuse']['sim']:4.0%}"
            )
    counts = {policy: cells_within(rows) for policy, rows in result.items()}
    within, cells = sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())
    per_policy = ", ".join(f"{p} {w}/{n}" for p, (w, n) in counts.items())
    print(
        f"(real / simulated (simulated over real, ok: within {tolerance:.0%}); times in ms; "
        f"n: simulated requests, !real count where they differ) {within} of {cells} cells within"
        f" ({per_policy})"
    )


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("real", type=Path, help="gpu_e2e.py's JSON report")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    parser.add_argument("--tolerance", type=float, default=0.2)
    parser.add_argument(
        "--cost-model", type=Path, help="JSON object of cost-model fields (default: the defaults)"
    )
    parser.add_argument(
        "--cost-model-from-report",
        action="store_true",
        help="the cost model from the report's calibration block, over --cost-model's",
    )
    parser.add_argument(
        "--between-steps-from-counters",
        action="store_true",
        help="host_between_steps_per_seq_ms from the report's engine counters",
    )
    parser.add_argument(
        "--reports-on-clock",
        action="store_true",
        help="workers' load reports taken on the health loop's own clock, not on arrivals",
    )
    parser.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="replace one cost-model field over --cost-model's (repeatable; a what-if)",
    )
    args = parser.parse_args()
    try:
        report = json.loads(args.real.read_text())
    except (OSError, ValueError) as exc:
        sys.exit(f"sim_vs_real: cannot read {args.real}: {exc}")
    try:
        base = json.loads(args.cost_model.read_text()) if args.cost_model else {}
        if not isinstance(base, dict):
            raise ValueError("expected a JSON object of cost-model fields")
        if args.cost_model_from_report:
            base, fitted = from_calibration(report, base)
            print_calibrated(args.real, fitted)
        cost = SimCostModel.from_mapping(base)
        if args.between_steps_from_counters:
            between = between_steps_per_seq_ms(report)
            if between is None:
                raise ValueError("the report's rows carry no engine counters (engine_steps)")
            print(f"  host_between_steps_per_seq_ms  {between:.3g} (the engines' counters)")
            cost = replace(cost, host_between_steps_per_seq_ms=round(between, 3))
        cost = SimCostModel.from_mapping(parse_overrides(args.cost), cost)
    except (OSError, ValueError) as exc:
        sys.exit(f"sim_vs_real: cannot use {args.cost_model or ''} {args.cost}: {exc}")
    result = compare(report, args.tolerance, cost, args.reports_on_clock)
    print_table(result, args.tolerance)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "tolerance": args.tolerance,
            "cost_model": cost.as_dict(),
            "cost_model_source": {
                "file": str(args.cost_model) if args.cost_model else None,
                "from_report_calibration": args.cost_model_from_report,
                "between_steps_from_counters": args.between_steps_from_counters,
                "overrides": args.cost,
                "reports_on_clock": args.reports_on_clock,
            },
        }
        args.json.write_text(json.dumps({**out, "results": result}, indent=2))


if __name__ == "__main__":
    main()
