"""A worker killed mid-stream: the request finishes on another worker, the client sees no error."""

from __future__ import annotations

import pytest
import ray

from kvmesh.proto import kvmesh_pb2 as pb
from tests.integration.helpers import generate, start_deployment, stub_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]


def test_stream_survives_its_worker_dying(ray_session: None) -> None:
    d = start_deployment(num_workers=2, num_blocks=128)
    try:
        assert d.cluster is not None
        stub = stub_for(d.address)
        prompt = [(i * 17) % 250 + 3 for i in range(40)]
        reference = [
            t for r in generate(stub, prompt, max_tokens=120, worker_id="w1") for t in r.token_ids
        ]

        req = pb.GenerateRequest(
            token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=120, ignore_eos=True),
            worker_id="w0",
        )
        tokens: list[int] = []
        killed = False
        last = None
        for resp in stub.Generate(req, timeout=60):
            tokens.extend(resp.token_ids)
            last = resp
            if len(tokens) >= 10 and not killed:
                ray.kill(d.cluster.actor("w0"), no_restart=True)
                killed = True
        assert killed and last is not None
        assert last.finish_reason == "length"
        assert len(tokens) == 120
        assert tokens == reference  # greedy: the continuation on w1 picks up exactly
        stats = stub.Stats(pb.StatsRequest())
        assert stats.num_failed_requests == 0 and stats.num_migrations == 1
    finally:
        d.stop()
