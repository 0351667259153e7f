"""Two workers sharing one GPU: a prefix pulled through CUDA IPC (the source asked while the
target reserves; once its cache is mapped, inside the request's admission on the engine thread)
gives the tokens a local hit gives, and both pools end balanced."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.redis]

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)


def test_prefix_pulled_on_the_same_gpu_over_cuda_ipc(ray_session: None) -> None:
    from kvmesh.proto import kvmesh_pb2 as pb
    from tests.integration.helpers import generate, start_deployment, stub_for, wait_for

    d = start_deployment(num_workers=2, num_blocks=512, gpus_per_worker=0.5)
    try:
        stub = stub_for(d.address)
        for round_ in range(3):  # the first maps the peer's cache; later ones reuse the mapping
            prefix = [(i * 7 + round_) % 250 + 3 for i in range(1024)]
            local = generate(stub, prefix + [1], max_tokens=5, worker_id="w0")

            def held(prefix: list[int] = prefix) -> bool:
                resp = stub.Lookup(pb.LookupRequest(token_ids=prefix))
                return any(m.worker_id == "w0" and m.matched_blocks == 64 for m in resp.matches)

            wait_for(held, what="w0's prefix in the index")
            pulled = generate(stub, prefix + [1], max_tokens=5, worker_id="w1")
            assert pulled[0].cache.pulled_tokens == 1024
            tokens = [t for r in pulled for t in r.token_ids]
            assert tokens == [t for r in local for t in r.token_ids]

        import ray

        counters = ray.get(d.cluster.actor("w1").info.remote()).counters
        # the first pull mapped w0's cache through the event loop; the others ran in admission
        assert (counters.num_pulls, counters.num_pulls_in_admission) == (3, 2)

        def balanced() -> bool:
            workers = stub.ListWorkers(pb.ListWorkersRequest()).workers
            return all(w.num_free_blocks == w.num_blocks for w in workers)

        wait_for(balanced, what="every block back in its pool (the source unpinned its runs)")
    finally:
        d.stop()
