"""Coordinator configuration: flags, then KVMESH_* environment variables, then these defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvmesh.coordinator.routing.router import POLICIES


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    model: str = "tiny-random"
    """Preset name or checkpoint folder; must match the workers'."""
    seed: int = 0
    """Seed of random-weight presets (part of the model fingerprint)."""
    block_size: int = 16
    """Tokens per KV block; must match the workers'."""
    policy: str = "kvmesh"
    """Routing policy name (see kvmesh.coordinator.routing.router.POLICIES)."""
    redis_url: str = field(default="", repr=False)
    """The index's Redis; empty runs without an index (load-only routing). `redis://` or
    `rediss://` (TLS), with a password or ACL user in it: never logged, hidden from repr."""
    host: str = "127.0.0.1"
    """gRPC listen address."""
    port: int = 50051
    """gRPC port (0 picks a free one)."""
    max_message_bytes: int = 16 << 20
    """Largest request the gRPC server accepts; bigger ones get RESOURCE_EXHAUSTED."""
    max_concurrent_rpcs: int = 256
    """Server threads: concurrent streams beyond this are refused with RESOURCE_EXHAUSTED."""
    max_migrations: int = 2
    """How often a request may move to another worker after its worker died mid-stream."""
    max_tokens_limit: int = 1 << 20
    """Largest max_tokens a request may ask for."""
    health_interval_s: float = 0.5
    """How often worker actors are checked for liveness."""
    stall_timeout_s: float = 15.0
    """A worker whose engine makes no progress (or that does not answer at all) this long while
    it has work is treated as dead: killed, its streams moved, its index entries purged."""
    route_seed: int = 0
    """Seed of the router's tie-breaking randomness."""
    decision_log: bool = False
    """Commit every routing decision to the fleet-wide decision log in Redis, and apply every
    replica's decisions from it in order (`routing/decision_log.py`): replicas over one fleet
    then share one policy state. Costs one Redis round trip per decision."""
    worker_side_door: bool = True
    """Reach a worker on this coordinator's Ray node through its request channel, a Unix socket
    (`workers/request_channel.py`), for submits, aborts and the output stream, instead of Ray
    actor calls (~0.65 ms against 1.7-2.7 ms a call on a GPU host). Workers on other nodes, and a
    channel that fails to open, use Ray either way; off, every worker does."""
    speculative_dispatch: bool = True
    """With `decision_log`: send each request to its worker as soon as it is decided and commit
    meanwhile, so the commit's round trip is off the request's path; a lost commit whose new
    decision picks another worker aborts the request there and sends it on (a redirect,
    `decision_replica.py`). On by default: on a 16-core CPU cluster it kept 2 and 4 replicas'
    p90 TTFT within 5 % of one coordinator where the log alone did not (docs/reliability.md)."""
    speculation_max_move_rate: float = 0.05
    """Speculative dispatch pauses while more than this share of the replica's recent
    decisions (about the last 64) were moved to another worker by a lost commit: where
    decisions collide that often, redirects cost more than the commit's trip saves."""
    max_commit_retries: int = 3
    """Lost commits (a peer committed first) a decision is retried after; then it is appended
    without the check, and counted."""
    session_affinity_blocks: float = 1.0
    """What keeping a session on the worker its last turn went to is worth to the kvmesh policy,
    in blocks of prefill: that worker's cost is lowered by this many blocks' prefill time (a
    cost term, no cliff: a busier or colder worker still loses). 0 disables; the warm-session
    chain on that worker is already priced through the index."""
    session_queue_timeout_s: float = 30.0
    """How long a turn sent with turn mode QUEUE waits for its session's turn in flight to end
    before it is refused (FAILED_PRECONDITION)."""
    max_prompt_tokens: int = 0
    """Longest prompt accepted, in tokens (0: the model's context); longer: INVALID_ARGUMENT."""
    max_concurrent_streams: int = 0
    """Generate streams served at once (0: only max_concurrent_rpcs bounds them); more get
    RESOURCE_EXHAUSTED while unary calls (Stats, admin) still get a thread."""
    rate_limit_rps: float = 0.0
    """Calls per second per client (its token when auth is on, else its IP address or IPv6 /64);
    0 disables. Over the rate: RESOURCE_EXHAUSTED."""
    rate_limit_burst: int = 0
    """Calls a client may make at once before the rate applies (0: max(1, rate_limit_rps))."""
    stream_send_timeout_s: float = 30.0
    """How long a Generate response may wait to be sent (the client's flow-control window full:
    it stopped reading) before the server cancels the stream and frees its slot; 0 disables."""
    auth_tokens: tuple[str, ...] = field(default=(), repr=False)
    """Bearer tokens accepted on every RPC; with these and admin_tokens empty, no auth."""
    admin_tokens: tuple[str, ...] = field(default=(), repr=False)
    """Bearer tokens for the admin RPCs (Drain, ClearCache, VerifyIndex, IndexTree, Scale); valid
    for all RPCs."""
    tls_cert_file: str = ""
    """PEM certificate chain of the gRPC server; with tls_key_file, the server speaks TLS only."""
    tls_key_file: str = ""
    """PEM private key of tls_cert_file."""
    tls_client_ca_file: str = ""
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        if not (math.isfinite(self.session_affinity_blocks) and self.session_affinity_blocks >= 0):
            raise ValueError(
                f"session_affinity_blocks must be a finite number >= 0,"
                f" got {self.session_affinity_blocks}"
            )
        if not (math.isfinite(self.session_queue_timeout_s) and self.session_queue_timeout_s >= 0):
            raise ValueError(
                f"session_queue_timeout_s must be a finite number >= 0,"
                f" got {self.session_queue_timeout_s}"
            )
        if not 0.0 <= self.speculation_max_move_rate <= 1.0:
            raise ValueError(
                f"speculation_max_move_rate must be in [0, 1], got {self.speculation_max_move_rate}"
            )
        if self.health_interval_s <= 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
        if self.stall_timeout_s <= self.health_interval_s:
            raise ValueError(
                f"stall_timeout_s ({self.stall_timeout_s}) must exceed health_interval_s"
                f" ({self.health_interval_s})"
            )
        self._check_limits()
        self._check_security()

    def _check_limits(self) -> None:
        names = ("max_prompt_tokens", "max_concurrent_streams", "rate_limit_burst")
        for name in (*names, "max_commit_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.stream_send_timeout_s) and self.stream_send_timeout_s >= 0):
            raise ValueError(
                f"stream_send_timeout_s must be a finite number >= 0,"
                f" got {self.stream_send_timeout_s}"
            )
        if not (math.isfinite(self.rate_limit_rps) and self.rate_limit_rps >= 0):
            raise ValueError(
                f"rate_limit_rps must be a finite number >= 0, got {self.rate_limit_rps}"
            )

    def _check_security(self) -> None:
        # Messages name the position of a bad token, never the token itself.
        for name in ("auth_tokens", "admin_tokens"):
            for i, token in enumerate(getattr(self, name)):
                if not token or any(c.isspace() or not c.isprintable() for c in token):
                    raise ValueError(f"{name}[{i}] must be non-empty printable text without spaces")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file needs the server's tls_cert_file and tls_key_file")


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The OpenAI-compatible HTTP API beside the gRPC server (same auth, rate and stream limits)."""

    host: str = "127.0.0.1"
    """HTTP listen address."""
    port: int = 8000
    """HTTP port (0 picks a free one)."""
    max_body_bytes: int = 16 << 20
    """Largest request body accepted; bigger ones get 413."""
    max_threads: int = 256
    """Requests whose blocking work runs at once (a stream holds a thread between tokens)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"http port must be in [0, 65535], got {self.port}")
        if self.max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {self.max_threads}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
