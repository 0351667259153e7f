"""The routing-policy interface: what every policy sees per worker, and what it must return.

Every policy sees the same facts per live worker (`WorkerView`: how much of the prompt it holds,
how much prefill work is queued on it, how many sequences it decodes) and returns a decision.
Policies that keep their own state (round-robin's cursor, SGLang's approximate tree) keep it in
the instance; randomness comes from the `random.Random` passed in and time from the clock passed
in, so runs are reproducible and the simulator can drive them on simulated time.

The concrete policies live in `kvmesh_policy`, `simple_policies` and `baselines`
(reimplementations of other systems' routers); `router.POLICIES` names them all.
"""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple, overload

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.proto.block_hash import BlockHash, num_reusable_tokens

if TYPE_CHECKING:
    from kvmesh.coordinator.routing.pull_planner import PullPlan, TransferPrice, TransferPrices
    from kvmesh.proto.placements import Placement

_TIE_EPSILON_MS = 1e-9


class WorkerView(NamedTuple):
    """One live worker as the router sees it for one prompt.

    A NamedTuple rather than a dataclass: the router builds one per worker per request, and a
    tuple is built 3-4x faster (it matters at hundreds of workers)."""

    worker_id: WorkerId
    num_blocks: int
    """Pool capacity, in blocks."""
    num_free_blocks: int
    """Free (possibly cached) blocks the worker last reported."""
    queued_prefill_ms: float
    """Predicted prefill work routed here and not yet done."""
    queued_prefill_tokens: int
    """Prefill tokens routed here and not yet prefilled (as given to `LoadTracker.on_routed`)."""
    num_running: int
    """Requests routed here and not finished."""
    matched_blocks: int
    """Leading prompt blocks this worker holds (any tier)."""
    matched_device_blocks: int
    """... of which the leading run on the device tier."""
    num_queued: int = 0
    """Of the requests routed here, those still waiting for or in their prefill (routed by this
    coordinator): each will run at least one step that carries the worker's decode batch."""


class WorkerColumns(Sequence[WorkerView]):
    """The live workers for one prompt as columns: one array per `WorkerView` field, row i being
    worker `ids[i]`. kvmesh's policy prices all rows at once; any other policy reads it as the
    sequence of `WorkerView`s it is (a row is built when indexed).

    Invariants: every array has len(ids) rows; ids are unique; the int columns are int64 and
    `queued_prefill_ms` float64; matched_device_blocks <= matched_blocks row by row.
    """

    __slots__ = (
        "ids",
        "num_blocks",
        "num_free_blocks",
        "queued_prefill_ms",
        "queued_prefill_tokens",
        "num_running",
        "matched_blocks",
        "matched_device_blocks",
        "num_queued",
        "_index_of",
    )

    def __init__(
        self,
        ids: Sequence[WorkerId],
        num_blocks: np.ndarray,
        num_free_blocks: np.ndarray,
        queued_prefill_ms: np.ndarray,
        queued_prefill_tokens: np.ndarray,
        num_running: np.ndarray,
        matched_blocks: np.ndarray,
        matched_device_blocks: np.ndarray,
        index_of: Mapping[WorkerId, int] | None = None,
        num_queued: np.ndarray | None = None,
    ) -> None:
        """`num_queued`: None is 0 for every worker."""
        self.ids = tuple(ids)
        self.num_blocks = np.asarray(num_blocks, dtype=np.int64)
        self.num_free_blocks = np.asarray(num_free_blocks, dtype=np.int64)
        self.queued_prefill_ms = np.asarray(queued_prefill_ms, dtype=np.float64)
        self.queued_prefill_tokens = np.asarray(queued_prefill_tokens, dtype=np.int64)
        self.num_running = np.asarray(num_running, dtype=np.int64)
        self.matched_blocks = np.asarray(matched_blocks, dtype=np.int64)
        self.matched_device_blocks = np.asarray(matched_device_blocks, dtype=np.int64)
        if num_queued is None:
            num_queued = np.zeros(len(self.ids), dtype=np.int64)
        self.num_queued = np.asarray(num_queued, dtype=np.int64)
        self._index_of = index_of
        n = len(self.ids)
        if not (
            len(self.num_blocks)
            == len(self.num_free_blocks)
            == len(self.queued_prefill_ms)
            == len(self.queued_prefill_tokens)
            == len(self.num_running)
            == len(self.matched_blocks)
            == len(self.matched_device_blocks)
            == len(self.num_queued)
            == n
        ):
            for name in self.__slots__[1:-1]:
                if len(getattr(self, name)) != n:
                    raise ValueError(f"{name} has {len(getattr(self, name))} rows for {n} workers")

    @classmethod
    def from_views(cls, views: Sequence[WorkerView]) -> WorkerColumns:
        if isinstance(views, WorkerColumns):
            return views
        fields = list(zip(*views, strict=True)) if views else [()] * len(WorkerView._fields)
        a = [np.array(f) for f in fields[1:]]
        return cls(fields[0], a[0], a[1], a[2], a[3], a[4], a[5], a[6], num_queued=a[7])

    @property
    def index_of(self) -> Mapping[WorkerId, int]:
        """Row of each worker id (built once, on first use)."""
        if self._index_of is None:
            self._index_of = {w: i for i, w in enumerate(self.ids)}
        return self._index_of

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> WorkerView: ...
    @overload
    def __getitem__(self, i: slice) -> list[WorkerView]: ...
    def __getitem__(self, i: int | slice) -> WorkerView | list[WorkerView]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return WorkerView(
            self.ids[i],
            int(self.num_blocks[i]),
            int(self.num_free_blocks[i]),
            float(self.queued_prefill_ms[i]),
            int(self.queued_prefill_tokens[i]),
            int(self.num_running[i]),
            int(self.matched_blocks[i]),
            int(self.matched_device_blocks[i]),
            int(self.num_queued[i]),
        )

    def __iter__(self) -> Iterator[WorkerView]:
        columns = (
            self.num_blocks.tolist(),
            self.num_free_blocks.tolist(),
            self.queued_prefill_ms.tolist(),
            self.queued_prefill_tokens.tolist(),
            self.num_running.tolist(),
            self.matched_blocks.tolist(),
            self.matched_device_blocks.tolist(),
            self.num_queued.tolist(),
        )
        return map(WorkerView._make, zip(self.ids, *columns, strict=True))


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """The prompt being routed."""

    request_id: str
    block_hashes: Sequence[BlockHash]
    """Chained hashes of the prompt's full blocks."""
    prompt_len: int
    """Prompt tokens (the partial tail block included)."""
    block_size: int
    """Tokens per block."""
    session_id: str = ""
    """Conversation the request belongs to; empty for none."""
    max_tokens: int | None = None
    """Tokens the request may generate, when the caller set them (None: unknown). kvmesh's
    policy prices a worker's decode load over them (`KvmeshWeights.decode_tokens_for`)."""
    block_hash_array: np.ndarray | None = field(default=None, compare=False, repr=False)
    """`block_hashes` as a uint64 array (`block_hash_array`), when the prompt was prepared
    with one: kvmesh's policy reads the hashes of its routed prefixes' lookups from it."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")

    @property
    def num_prompt_blocks(self) -> int:
        return -(-self.prompt_len // self.block_size)


class WorkerScore(NamedTuple):
    """A policy's price of one worker for one prompt (lower is better); a NamedTuple for the
    same reason as `WorkerView`."""

    worker_id: WorkerId
    matched_blocks: int
    cost_ms: float


class ScoreColumns(Sequence[WorkerScore]):
    """Every worker's score for one decision, kept as the arrays that priced them: a
    `WorkerScore` is built only when read (most decisions are never inspected)."""

    __slots__ = ("_ids", "_matched_blocks", "_costs_ms")

    def __init__(
        self, ids: Sequence[WorkerId], matched_blocks: np.ndarray, costs_ms: np.ndarray
    ) -> None:
        self._ids, self._matched_blocks, self._costs_ms = ids, matched_blocks, costs_ms

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> WorkerScore: ...
    @overload
    def __getitem__(self, i: slice) -> list[WorkerScore]: ...
    def __getitem__(self, i: int | slice) -> WorkerScore | list[WorkerScore]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return WorkerScore(self._ids[i], int(self._matched_blocks[i]), float(self._costs_ms[i]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __hash__(self) -> int:
        return hash(tuple(self))


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The chosen worker and the scores that chose it."""

    worker_id: WorkerId
    matched_blocks: int
    """Leading prompt blocks the chosen worker holds."""
    cost_ms: float
    """The chosen worker's score (a time for kvmesh; other policies use their own units)."""
    predicted_prefill_ms: float
    """What the load tracker should queue on the chosen worker."""
    scores: Sequence[WorkerScore]
    """Every worker's score, in the order the workers were given."""
    pull: PullPlan | None = None
    """Blocks the chosen worker should first fetch from a peer (kvmesh's policy only)."""
    session_worker_id: str = ""
    """The worker the request's session last went to (kvmesh's policy; empty: none known)."""
    session_affinity_ms: float = 0.0
    """What that worker's cost was lowered by for the session (included in the scores)."""
    indexed_blocks: int = 0
    """Leading prompt blocks the chosen worker holds by the index alone (kvmesh's policy counts
    blocks routed there lately too, in `matched_blocks`)."""


class RoutingPolicy(ABC):
    """Contract: `choose` gets at least one worker and returns one of them; it never blocks.

    The `on_*` hooks are optional feedback; a policy must stay correct (and bounded in memory)
    when a caller never calls them.
    """

    name: ClassVar[str]
    replicable: ClassVar[bool] = False
    """True if the policy splits `choose` into `propose` and `place`, so replicas can share its
    state through the decision log (`decision_log.py`); others commit without conditions."""

    def __init__(
        self,
        cost_model: CostModel,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cost_model = cost_model
        self.rng = rng
        self.clock = clock  # seconds; only differences are used
        # Set by the coordinator when workers can pull blocks from each other; None: no pulls.
        self.transfer_ms: TransferPrice | None = None
        # The same prices for many targets at once (one source), when the pricer has them.
        self.transfer_ms_many: TransferPrices | None = None
        # True when `transfer_ms` depends on the tokens moved alone, not on the pair.
        self.transfer_ms_uniform = False

    @abstractmethod
    def choose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision: ...

    def propose(self, query: RouteQuery, workers: Sequence[WorkerView]) -> RouteDecision:
        """`choose` without remembering the decision (only where `replicable`)."""
        raise NotImplementedError(f"policy {self.name} cannot propose without choosing")

    def placement_of(
        self, query: RouteQuery, decision: RouteDecision, indexed: int, origin: str = ""
    ) -> Placement:
        """The decision as the decision log carries it, for `place` (only where `replicable`;
        `indexed`: the chosen worker's match in the index, before routed prefixes)."""
        raise NotImplementedError(f"policy {self.name} keeps no state the log can carry")

    def place(self, placement: Placement, now_s: float) -> None:  # noqa: B027 - optional hook
        """Remember a committed decision, this replica's or a peer's, as `choose` would have
        (only where `replicable`); `choose` = `propose`, then `place` of its result."""

    def on_worker_removed(self, worker_id: WorkerId) -> None:  # noqa: B027 - optional hook
        """Forget any state about a worker that left."""

    def on_request_done(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """A routed request finished (or failed); policies that track active work release it."""

    def _pick_lowest(
        self, query: RouteQuery, workers: Sequence[WorkerView], costs: Sequence[float]
    ) -> RouteDecision:
        if not workers:
            raise ValueError("no workers to route to")
        best = min(costs)
        tied = [i for i, c in enumerate(costs) if c <= best + _TIE_EPSILON_MS]
        i = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        w = workers[i]
        scores = tuple(
            WorkerScore(v.worker_id, v.matched_blocks, c)
            for v, c in zip(workers, costs, strict=True)
        )
        return RouteDecision(
            w.worker_id, w.matched_blocks, costs[i], self._prefill_ms(query, w), scores
        )

    def _prefill_ms(self, query: RouteQuery, w: WorkerView) -> float:
        cached = self._cached_tokens(query, w)
        return self.cost_model.prefill_ms(query.prompt_len - cached, cached)

    @staticmethod
    def _cached_tokens(query: RouteQuery, w: WorkerView) -> int:
        return num_reusable_tokens(query.prompt_len, w.matched_blocks, query.block_size)


class SessionMap:
    """Which worker each session last went to; the least recently used session goes first.

    Bounded in entries and in bytes, since session ids come from clients: an entry costs its
    session id's UTF-8 bytes plus `ENTRY_OVERHEAD_BYTES` (the dict slot, the str objects).
    Invariants: len <= max_sessions; num_bytes <= max_bytes; num_bytes is the sum of the entries'
    costs.
    """

    ENTRY_OVERHEAD_BYTES = 200

    def __init__(self, max_sessions: int = 100_000, max_bytes: int = 32 << 20) -> None:
        if max_sessions < 1 or max_bytes < self.ENTRY_OVERHEAD_BYTES:
            raise ValueError(
                f"need max_sessions >= 1 and max_bytes >= {self.ENTRY_OVERHEAD_BYTES},"
                f" got {max_sessions} and {max_bytes}"
            )
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._session_to_worker: OrderedDict[str, WorkerId] = OrderedDict()

    def __len__(self) -> int:
        return len(self._session_to_worker)

    def get(self, session_id: str) -> WorkerId | None:
        return self._session_to_worker.get(session_id) if session_id else None

    def remember(self, session_id: str, worker: WorkerId) -> None:
        cost = self._cost(session_id)
        if not session_id or cost > self.max_bytes:
            return  # nothing to remember, or it could never fit: affinity is only a hint
        if session_id not in self._session_to_worker:
            self.num_bytes += cost
        self._session_to_worker[session_id] = worker
        self._session_to_worker.move_to_end(session_id)
        while len(self._session_to_worker) > self.max_sessions or self.num_bytes > self.max_bytes:
            oldest, _ = self._session_to_worker.popitem(last=False)
            self.num_bytes -= self._cost(oldest)

    def forget_worker(self, worker: WorkerId) -> None:
        for s in [s for s, w in self._session_to_worker.items() if w == worker]:
            del self._session_to_worker[s]
            self.num_bytes -= self._cost(s)

    def check_invariants(self) -> None:
        assert len(self._session_to_worker) <= self.max_sessions
        assert self.num_bytes <= self.max_bytes
        assert self.num_bytes == sum(self._cost(s) for s in self._session_to_worker)

    def _cost(self, session_id: str) -> int:
        return len(session_id.encode("utf-8", "surrogatepass")) + self.ENTRY_OVERHEAD_BYTES
