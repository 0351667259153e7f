"""The knobs of kvmesh's cost (`KvmeshPolicy`), one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvmeshWeights:
    """The knobs of kvmesh's cost (defaults tuned with `kvmesh simulate`, docs/benchmarks.md)."""

    recompute_weight: float = 1.0
    """Recomputed prefill is counted (1 + this) times: once as this request's latency, and again
    as GPU time taken from the requests that queue behind it later. 0 is purely greedy."""
    placement_balance: float = 0.3
    """Weight of the work recently routed to a worker, scaled by the share of the prompt it would
    compute: new prefixes go where little was placed lately, since their followers come too."""
    request_balance: float = 0.1
    """Weight of the requests recently routed to a worker, scaled by the cheapest prefill of
    this prompt anywhere: keeps a hot prefix's holder from taking every follower."""
    new_prefix_balance: float = 4.0
    """Weight of the prompts a worker was lately given from scratch (decayed count), scaled by
    this prompt's cheapest prefill, for a prompt nobody holds (not even as a routed prefix):
    new prefixes are dealt out evenly, as a tree router deals out equal groups, since each
    brings its followers. A prompt that some worker holds is priced without it. 4, the weight
    measured (docs/benchmarks.md, "new prompts dealt evenly"). 0 disables."""
    balance_horizon_s: float = 10.0
    """How far back "recently" reaches (exponential decay time)."""
    routed_prefix_ttl_s: float = 30.0
    """How long a routed prompt counts as held by its worker before the index confirms it."""
    decode_tokens: float = 16.0
    """Output tokens over which a worker's decode load is priced when the request's answer length
    is unknown: each of this request's steps on w is slower by what w's batch reads more than the
    lightest worker's, and the request makes each of theirs slower as much, so the difference is
    paid twice per token. Fewer than a typical answer's tokens, since batches even out as
    sequences finish. 0 prices one step."""
    decode_share: float = 1 / 16
    """With the request's max_tokens known, the tokens priced are this share of them instead: a
    256-token answer is priced as an unknown one (16), an agent's 64-token action a quarter of
    that, a 640-token answer 2.5 times. A short answer barely feels the batch it joins, so it
    stays with its cache; a long one reads the batch's KV on every step, so it moves sooner."""
    max_decode_tokens: float = 64.0
    """Most tokens priced whatever max_tokens says: max_tokens is a bound a client may set far
    above the answer, and a batch evens out within a few hundred steps anyway."""
    eviction_weight: float = 4.0
    """Price of each block a placement stores on w (what w lacks of the prompt on its device,
    computed or pulled), in that block's prefill time, times the share of w's pool that the
    prefixes reused there within `balance_horizon_s` fill (at most 1): where they fill the pool,
    what the stored block displaces is a prefix due again soon; where they fill a corner of it,
    the stale rest goes. Above 1 since a displaced prefix is recomputed by each follower that
    finds it gone; 4 is the least that stopped copies from spreading shared-prefix's prompts
    over 64K-token pools (docs/benchmarks.md). 0 stores copies for free."""
    memory_weight: float = 4.0
    """Price of the KV blocks a request holds on w (what it stores of the prompt there, computed
    or pulled, and its answer's blocks) for its answer's steps of w's batch, as the share of w's
    pool they take: the answer's blocks times the square of the share of the pool in use there
    (where the pool is full, every block held is one the next request at w waits for, until this
    answer ends; where it is half empty, seldom), the stored prompt blocks times the share
    itself (they stay while the prompt's followers come, and a pool in use now fills). Above 1
    since a block held delays each request queued behind it, not one; 4 (docs/benchmarks.md,
    "memory held"). 0 holds blocks for free."""
    unknown_answer_tokens: float = 256.0
    """Answer length the memory term assumes when the request's max_tokens is unknown (the
    answer that `decode_tokens` stands for: 16 tokens priced at `decode_share`)."""
    session_affinity_blocks: float = 1.0
    """A session's pull towards the worker its last turn went to, in blocks of prefill time
    (`CoordinatorConfig.session_affinity_blocks`); 0 disables."""

    def __post_init__(self) -> None:
        for name in (
            "recompute_weight",
            "placement_balance",
            "request_balance",
            "new_prefix_balance",
            "decode_tokens",
            "decode_share",
            "max_decode_tokens",
            "eviction_weight",
            "memory_weight",
            "unknown_answer_tokens",
            "session_affinity_blocks",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("balance_horizon_s", "routed_prefix_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def decode_tokens_for(self, max_tokens: int | None) -> float:
        """Output tokens over which this request's decode load is priced (see `decode_share`)."""
        if max_tokens is None:
            return self.decode_tokens
        return min(self.decode_share * max_tokens, self.max_decode_tokens)

    def answer_tokens_for(self, max_tokens: int | None) -> float:
        """Tokens the request's answer holds its blocks for (see `memory_weight`)."""
        return self.unknown_answer_tokens if max_tokens is None else float(max_tokens)
