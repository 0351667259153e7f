"""The CLI's read commands (`generate`, `route`, `lookup`, `stats`, `workers`).

Each handler takes the parsed arguments, makes one client call and prints either one JSON
document (`--json`: stable keys, for scripts) or short aligned text (for people). Failures are
raised, never printed here: `cli.main` owns the one-line error format and the exit codes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from typing import Any

from kvmesh.client.client import Client
from kvmesh.client.credentials import tls_credentials
from kvmesh.client.results import GenerateResult, LookupResult, RouteResult, Stats, WorkerInfo
from kvmesh.client.table import format_fields, format_table
from kvmesh.client.wire import MAX_UINT32

_TOKEN_SEPARATOR = re.compile(r"[\s,]+")


def parse_token_ids(text: str, flag: str = "--tokens") -> list[int]:
    """Token ids from "1,2,3" (commas and/or whitespace); ValueError naming the bad item."""
    parts = [p for p in _TOKEN_SEPARATOR.split(text.strip()) if p]
    if not parts:
        raise ValueError(f"{flag} is empty; give token ids like 1,2,3")
    ids: list[int] = []
    for i, part in enumerate(parts):
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{flag}: item {i} ({part!r}) is not an integer") from None
        if not 0 <= value <= MAX_UINT32:
            raise ValueError(f"{flag}: item {i} ({value}) is outside [0, {MAX_UINT32}]")
        ids.append(value)
    return ids


def _prompt_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`token_ids` or `prompt` for a client call, from the --tokens / --prompt pair, with the
    --adapter and --media options."""
    extra = {"adapter": args.adapter, "media": tuple(args.media or ())}
    if args.tokens is not None:
        return {"token_ids": parse_token_ids(args.tokens), **extra}
    return {"prompt": args.prompt, **extra}


def _client(args: argparse.Namespace) -> Client:
    return client_from_args(args, args.address)


def client_from_args(args: argparse.Namespace, address: str) -> Client:
    """A client for `address` (or `A,B,...`: replicas to fail over between) with the command's
    timeout, token and TLS flags."""
    use_tls = args.tls or args.tls_ca or args.tls_cert
    credentials = tls_credentials(args.tls_ca, args.tls_cert, args.tls_key) if use_tls else None
    addresses = [a.strip() for a in address.split(",") if a.strip()]
    return Client(addresses, timeout_s=args.timeout, token=args.token, credentials=credentials)


def _print_json(document: object) -> None:
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")


def run_generate(args: argparse.Namespace) -> int:
    stop = parse_token_ids(args.stop_token_ids, "--stop-token-ids") if args.stop_token_ids else []
    with _client(args) as client:
        result = client.generate(
            **_prompt_kwargs(args),
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop_token_ids=stop,
            ignore_eos=args.ignore_eos,
            session_id=args.session,
            cache_salt=args.cache_salt,
            worker_id=args.worker,
            bypass_cache=args.bypass_cache,
        )
    if args.json:
        _print_json(asdict(result))
    else:
        print(render_generation(result))
    return 0


def render_generation(result: GenerateResult) -> str:
    tokens = " ".join(str(t) for t in result.tokens)
    return format_fields(
        [
            ("worker", result.worker_id),
            ("tokens", tokens),
            ("text", repr(result.text) if result.text else None),
            ("finish_reason", result.finish_reason),
            ("prompt_tokens", result.prompt_tokens),
            ("cached_tokens", result.cached_tokens),
            ("pulled_tokens", result.pulled_tokens),
            ("computed_tokens", result.computed_tokens),
            ("ttft_ms", result.ttft_ms),
            ("total_ms", result.total_ms),
            ("request_id", result.request_id),
        ]
    )


def run_route(args: argparse.Namespace) -> int:
    with _client(args) as client:
        result = client.route(
            **_prompt_kwargs(args),
            session_id=args.session,
            cache_salt=args.cache_salt,
            bypass_cache=args.bypass_cache,
            max_tokens=args.max_tokens,
        )
    if args.json:
        _print_json(asdict(result))
    else:
        print(render_route(result))
    return 0


def render_route(result: RouteResult) -> str:
    summary = format_fields(
        [
            ("worker", result.worker_id),
            ("policy", result.policy),
            ("prompt_tokens", result.prompt_tokens),
            ("matched_tokens", result.matched_tokens),
            ("cost_ms", result.cost_ms),
        ]
    )
    if not result.scores:
        return summary
    rows = [[s.worker_id, s.matched_blocks, s.cost_ms] for s in result.scores]
    return summary + "\n\n" + format_table(["worker", "matched_blocks", "cost_ms"], rows)


def run_lookup(args: argparse.Namespace) -> int:
    with _client(args) as client:
        result = client.lookup(**_prompt_kwargs(args), cache_salt=args.cache_salt)
    if args.json:
        _print_json(asdict(result))
    else:
        print(render_lookup(result))
    return 0


def render_lookup(result: LookupResult) -> str:
    summary = format_fields([("num_blocks", result.num_blocks)])
    if not result.matches:
        return summary + "\nno worker holds a prefix of this prompt"
    rows = [[m.worker_id, m.matched_blocks, m.matched_tokens] for m in result.matches]
    return summary + "\n\n" + format_table(["worker", "matched_blocks", "matched_tokens"], rows)


def run_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats()
    if args.json:
        _print_json(asdict(stats))
    else:
        print(render_stats(stats))
    return 0


def render_stats(stats: Stats) -> str:
    """One line per figure; the cache's as `cache.<name>`."""
    items = [(k, v) for k, v in asdict(stats).items() if k != "cache"]
    items += [(f"cache.{k}", v) for k, v in asdict(stats.cache).items()]
    return format_fields(items)


def run_scale(args: argparse.Namespace) -> int:
    with _client(args) as client:
        result = client.scale(args.workers, drain_timeout_s=args.drain_timeout)
    if args.json:
        _print_json(asdict(result))
    else:
        started = ", ".join(result.started_worker_ids) or "none"
        stopped = ", ".join(result.stopped_worker_ids) or "none"
        print(f"{result.num_workers} workers (started: {started}; stopped: {stopped})")
    return 0


def run_workers(args: argparse.Namespace) -> int:
    with _client(args) as client:
        workers = client.list_workers()
    if args.json:
        _print_json([asdict(w) for w in workers])
    else:
        print(render_workers(workers))
    return 0


def render_workers(workers: list[WorkerInfo]) -> str:
    if not workers:
        return "no workers"
    headers = ["worker", "kind", "alive", "device", "node", "pid", "blocks", "free", "indexed"]
    headers += ["running", "waiting", "requests", "cached_tok", "computed_tok", "gen"]
    headers += ["hits", "misses", "saved_tok", "entries", "evicted", "kv_dtype", "epoch"]
    rows = [
        [
            w.worker_id,
            w.kind or "kvmesh",  # a coordinator from before kinds sends none
            w.alive,
            w.device,
            w.node,
            w.pid,
            w.num_blocks,
            w.num_free_blocks,
            w.num_indexed_blocks,
            w.num_running,
            w.num_waiting,
            w.num_requests,
            w.cached_tokens,
            w.computed_tokens,
            w.generation,
            w.cache.num_lookup_hits,
            w.cache.num_lookup_misses,
            w.cache.saved_prefill_tokens,
            w.cache.num_entries,
            w.cache.num_device_evictions + w.cache.num_host_evictions,
            w.cache.kv_dtype if w.cache.enabled else f"{w.cache.kv_dtype} (off)",
            w.cache.cache_epoch,
        ]
        for w in workers
    ]
    return format_table(headers, rows)
