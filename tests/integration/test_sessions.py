"""Sessions on a real deployment (embedded Redis, local Ray workers, gRPC coordinator): an idle
session's chain outlives other free blocks on its worker, a migrated turn keeps its session, and
a second concurrent turn that asks for exclusivity is refused with FAILED_PRECONDITION."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig
from tests.integration.helpers import TEST_DEVICE, generate, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

NUM_BLOCKS = 64
FIRST_TURN = [(i * 11) % 250 + 3 for i in range(64)]  # 4 full blocks of 16


@pytest.fixture
def deployment(ray_session: None) -> Iterator[Deployment]:
    sessions = WarmSessionConfig(idle_ttl_s=600.0, budget_fraction=0.25)
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(port=0),
        num_workers=2,
        worker=WorkerConfig(
            worker_id="template", num_blocks=NUM_BLOCKS, device=TEST_DEVICE, sessions=sessions
        ),
    )
    d = Deployment(config)
    d.start()
    yield d
    d.stop()


def _worker_info(stub: object, worker_id: str) -> pb.WorkerInfo:
    workers = stub.ListWorkers(pb.ListWorkersRequest()).workers  # type: ignore[attr-defined]
    return next(w for w in workers if w.worker_id == worker_id)


def test_idle_session_next_turn_hits_after_churn_evicts_other_free_blocks(
    deployment: Deployment,
) -> None:
    stub = stub_for(deployment.address)
    first = generate(stub, FIRST_TURN, max_tokens=4, session_id="chat", worker_id="w0")
    answer = [t for r in first for t in r.token_ids]
    loner = [(i * 13) % 250 + 5 for i in range(64)]  # the same shape, no session
    generate(stub, loner, max_tokens=4, worker_id="w0")
    for i in range(12):  # 12 x 9 blocks: more than the pool's 64 cycle through w0
        churn = [(i * 31 + j * 17) % 250 + 3 for j in range(130)]
        generate(stub, churn, max_tokens=4, worker_id="w0")
    wait_for(lambda: _worker_info(stub, "w0").num_warm_sessions == 1, what="w0's report")
    loner_again = generate(stub, loner + [1, 2], max_tokens=1, worker_id="w0")
    assert loner_again[0].cache.cached_tokens == 0  # the churn did evict ordinary free blocks
    second = generate(
        stub, FIRST_TURN + answer + [7, 8, 9], max_tokens=4, session_id="chat", worker_id="w0"
    )
    assert second[0].cache.cached_tokens == 64  # the whole first prompt, kept warm
    stats = stub.Stats(pb.StatsRequest())
    assert stats.num_warm_sessions >= 1 and stats.warm_session_bytes > 0


def test_migrated_turn_keeps_its_session_and_a_second_exclusive_turn_is_refused(
    deployment: Deployment,
) -> None:
    stub = stub_for(deployment.address)
    sampling = pb.SamplingParams(max_tokens=160, ignore_eos=True)
    turn = pb.GenerateRequest(
        token_ids=FIRST_TURN, sampling=sampling, session_id="chat", worker_id="w0"
    )
    stream = stub.Generate(turn, timeout=120)
    tokens: list[int] = []
    for response in stream:
        tokens += response.token_ids
        if len(tokens) >= 4:
            break
    # While the turn streams, another turn of the session that asks to be alone is refused.
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, FIRST_TURN, max_tokens=1, session_id="chat", turn_mode=pb.TURN_MODE_REFUSE)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    os.kill(_worker_info(stub, "w0").pid, signal.SIGKILL)
    for response in stream:  # the turn goes on on w1
        tokens += response.token_ids
    assert len(tokens) == 160
    # w1 kept the migrated turn's chain warm under the turn's session.
    wait_for(lambda: _worker_info(stub, "w1").num_warm_sessions == 1, what="w1 keeps the session")
    route = stub.Route(pb.RouteRequest(token_ids=FIRST_TURN + tokens, session_id="chat"))
    alone = stub.Route(pb.RouteRequest(token_ids=FIRST_TURN + tokens))
    assert (route.session_worker_id, alone.session_worker_id) == ("w1", "")
    # The affinity is a price the session earns (ms of prefill), not a time: none without it.
    assert route.session_affinity_ms != alone.session_affinity_ms == 0
    assert stub.Stats(pb.StatsRequest()).num_session_turns_refused == 1
