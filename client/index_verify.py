"""`kvmesh index verify`: does the index say what the workers really hold?

Three views of every worker's blocks are compared, each against the most authoritative one
available for that worker:

    pool                 what the worker's KV pool holds (through the coordinator that runs it)
    redis                the worker's block set in Redis (`--redis-url`)
    mirror@HOST:PORT     each coordinator's in-memory mirror (one per `--address`)

The pool is the reference when a queried coordinator runs the worker; otherwise Redis is. Under
traffic the views legitimately differ for a few milliseconds (a step's events are in flight), so
the comparison is repeated until it agrees or `--wait` runs out; only then is a difference real.
Each mirror's radix tree is checked too, and with `--redis-url` the radix metadata in Redis (the
tree a cold coordinator starts from): every block deeper than 1 must hang off a block some worker
holds (else no prompt can reach it: an orphan), one level below it.
Exit code 0: consistent; 1: differences (or a call failed).

Reading Redis needs the coordinator's index store, imported only when `--redis-url` is given (the
same lazy import as `kvmesh up`): the command otherwise needs nothing but the client.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from kvmesh.client.commands import client_from_args
from kvmesh.client.errors import KVMeshError
from kvmesh.client.results import IndexReport
from kvmesh.client.table import format_table

POOL = "pool"
REDIS = "redis"
_SHOWN_HASHES = 8  # per difference, in the report; the counts are always complete
_RETRY_S = 0.25


@dataclass(frozen=True, slots=True)
class Difference:
    worker_id: str
    source: str
    """The view that is wrong: "redis" or "mirror@HOST:PORT"."""
    reference: str
    """The view it was compared with: "pool", or "redis" for a worker no coordinator runs."""
    num_missing: int
    """Blocks the reference has and the source lacks."""
    num_extra: int
    """Blocks the source has and the reference does not."""
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class VerifyReport:
    counts: dict[str, dict[str, int]]
    """worker -> view -> number of blocks."""
    differences: list[Difference]
    notes: list[str]
    link_problems: list[str] = field(default_factory=list)
    """Broken parent links in a coordinator's radix tree (orphans, depths off by more than 1)."""

    @property
    def consistent(self) -> bool:
        return not self.differences and not self.link_problems


def compare(
    reports: Mapping[str, IndexReport], redis_sets: Mapping[str, set[int]] | None
) -> VerifyReport:
    """Compare coordinators' reports (by address) and, if given, Redis's worker block sets."""
    pools = {
        w.worker_id: set(w.pool_hashes) for r in reports.values() for w in r.workers if w.owned
    }
    views: dict[str, dict[str, set[int]]] = {
        f"mirror@{address}": {w.worker_id: set(w.mirror_hashes) for w in r.workers}
        for address, r in reports.items()
    }
    if redis_sets is not None:
        views[REDIS] = {w: set(h) for w, h in redis_sets.items()}
    workers = set(pools).union(*(set(v) for v in views.values()))
    counts: dict[str, dict[str, int]] = {}
    differences = []
    for w in sorted(workers):
        counts[w] = {POOL: len(pools[w])} if w in pools else {}
        counts[w].update({name: len(sets.get(w, ())) for name, sets in views.items()})
        if w in pools:
            reference_name, reference = POOL, pools[w]
        elif redis_sets is not None:
            reference_name, reference = REDIS, views[REDIS].get(w, set())
        else:
            continue  # no coordinator runs it and Redis was not read: nothing to hold it to
        for name, sets in views.items():
            if name != reference_name:
                diff = _difference(w, name, sets.get(w, set()), reference_name, reference)
                if diff is not None:
                    differences.append(diff)
    notes = [
        f"coordinator {address} cannot reach Redis: its mirror is frozen (load-only routing)"
        for address, r in reports.items()
        if not r.redis_connected
    ]
    return VerifyReport(counts, differences, notes, _link_problems(reports))


def _link_problems(reports: Mapping[str, IndexReport]) -> list[str]:
    problems = []
    for address, r in reports.items():
        links = r.links
        if links.num_orphans:
            shown = [f"{h:016x}" for h in links.orphan_hashes[:_SHOWN_HASHES]]
            problems.append(
                f"mirror@{address}: {links.num_orphans} block(s) whose parent no worker holds"
                f" {shown}"
            )
        if links.num_bad_depths:
            shown = [f"{h:016x}" for h in links.bad_depth_hashes[:_SHOWN_HASHES]]
            problems.append(
                f"mirror@{address}: {links.num_bad_depths} block(s) not one level below their"
                f" parent {shown}"
            )
    return problems


def _difference(
    worker: str, source: str, got: set[int], reference_name: str, reference: set[int]
) -> Difference | None:
    missing, extra = reference - got, got - reference
    if not missing and not extra:
        return None
    return Difference(
        worker,
        source,
        reference_name,
        len(missing),
        len(extra),
        [f"{h:016x}" for h in sorted(missing)[:_SHOWN_HASHES]],
        [f"{h:016x}" for h in sorted(extra)[:_SHOWN_HASHES]],
    )


def read_redis_sets(redis_url: str) -> tuple[dict[str, set[int]], list[str]]:
    """Every registered worker's block set in Redis, and what is wrong with the radix links
    Redis keeps for those blocks."""
    # Server-side modules: only with --redis-url.
    from kvmesh.coordinator.index.radix_tree import RadixTree
    from kvmesh.coordinator.index.store import IndexStore

    try:
        store = IndexStore(redis_url)
        try:
            snapshots = [s for w in store.worker_ids() if (s := store.snapshot(w)) is not None]
        finally:
            store.close()
    except Exception as exc:  # redis-py's errors; the URL (it may hold a password) is not shown
        raise KVMeshError("UNAVAILABLE", f"cannot read the index from Redis: {exc}") from None
    tree = RadixTree()
    for snapshot in snapshots:  # each block's link as any worker holding it recorded it
        for h, parent, depth in snapshot.links.tuples():
            tree.link((h,), parent, depth)
    check = tree.check_links(_SHOWN_HASHES)
    problems = []
    if check.num_orphans:
        shown = [f"{h:016x}" for h in check.orphans]
        problems.append(f"redis: {check.num_orphans} block(s) whose parent no worker holds {shown}")
    if check.num_bad_depths:
        shown = [f"{h:016x}" for h in check.bad_depths]
        problems.append(
            f"redis: {check.num_bad_depths} block(s) not one level below their parent {shown}"
        )
    sets = {s.worker_id: {int(h) for h, _tier in s.blocks} for s in snapshots}
    return sets, problems


def verify(args: argparse.Namespace) -> tuple[VerifyReport, int, dict[str, IndexReport]]:
    """The report of the last attempt, the number of attempts and the coordinators' views."""
    deadline = time.monotonic() + args.wait
    attempts = 0
    while True:
        attempts += 1
        redis_sets, redis_link_problems = (
            read_redis_sets(args.redis_url) if args.redis_url else (None, [])
        )
        reports = {}
        for address in args.address:
            with client_from_args(args, address) as client:
                reports[address] = client.index_views()
        report = compare(reports, redis_sets)
        report.link_problems.extend(redis_link_problems)
        if report.consistent or time.monotonic() >= deadline:
            return report, attempts, reports
        time.sleep(_RETRY_S)


def run_index_verify(args: argparse.Namespace) -> int:
    report, attempts, reports = verify(args)
    if args.json:
        document = {
            "consistent": report.consistent,
            "attempts": attempts,
            "redis_compared": bool(args.redis_url),
            "counts": report.counts,
            "differences": [asdict(d) for d in report.differences],
            "link_problems": report.link_problems,
            "tree_nodes": {a: r.links.num_tree_nodes for a, r in reports.items()},
            "notes": report.notes,
        }
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(report, attempts, redis_compared=bool(args.redis_url)))
    return 0 if report.consistent else 1


def render(report: VerifyReport, attempts: int, *, redis_compared: bool) -> str:
    views = sorted({name for c in report.counts.values() for name in c}, key=_view_order)
    rows = [[w, *(c.get(v, "-") for v in views)] for w, c in report.counts.items()]
    lines = [format_table(["worker", *views], rows)] if rows else ["no workers"]
    lines += [f"note: {n}" for n in report.notes]
    if not redis_compared:
        lines.append("note: Redis not compared (give --redis-url or set KVMESH_REDIS_URL)")
    for d in report.differences:
        lines.append(
            f"DIFFERENCE {d.worker_id}: {d.source} lacks {d.num_missing} block(s) {d.reference}"
            f" has {d.missing}, and has {d.num_extra} it lacks {d.extra}"
        )
    lines += [f"LINKS {p}" for p in report.link_problems]
    num_problems = len(report.differences) + len(report.link_problems)
    verdict = "consistent" if report.consistent else f"{num_problems} difference(s)"
    lines.append(f"{verdict} after {attempts} attempt(s)")
    return "\n".join(lines)


def _view_order(name: str) -> tuple[int, str]:
    return ({POOL: 0, REDIS: 1}.get(name, 2), name)
