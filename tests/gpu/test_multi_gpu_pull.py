"""Two GPUs, one worker each: a prefix pulled over NCCL gives the tokens a local hit gives."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.redis]

if torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)


def test_prefix_pulled_across_gpus_over_nccl(ray_session: None) -> None:
    from kvmesh.proto import kvmesh_pb2 as pb
    from tests.integration.helpers import generate, start_deployment, stub_for, wait_for

    d = start_deployment(num_workers=2, num_blocks=512)
    try:
        assert d.cluster is not None and d.cluster.nccl_members()  # one rank per GPU
        stub = stub_for(d.address)
        prefix = [(i * 7) % 250 + 3 for i in range(1024)]
        local = generate(stub, prefix + [1], max_tokens=5, worker_id="w0")

        def held() -> bool:
            resp = stub.Lookup(pb.LookupRequest(token_ids=prefix))
            return any(m.worker_id == "w0" and m.matched_blocks == 64 for m in resp.matches)

        wait_for(held, what="w0's prefix in the index")
        pulled = generate(stub, prefix + [1], max_tokens=5, worker_id="w1")
        assert pulled[0].cache.pulled_tokens == 1024
        assert [t for r in pulled for t in r.token_ids] == [t for r in local for t in r.token_ids]
    finally:
        d.stop()
