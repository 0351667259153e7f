"""Adapters and media items through a real deployment (real Redis, real Ray, two workers that
serve a LoRA adapter written by the test in PEFT's layout)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.model.model_config import ModelConfig, preset
from tests.integration.helpers import TEST_DEVICE, generate, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

PROMPT = [(i * 13) % 250 + 3 for i in range(70)]


def write_peft_adapter(folder: Path, config: ModelConfig, rank: int = 4, seed: int = 0) -> None:
    """A random LoRA on q_proj and v_proj, in the files and tensor names peft writes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    tensors = {}
    for i in range(config.num_layers):
        for module, out_dim in (("q_proj", q_dim), ("v_proj", kv_dim)):
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, config.hidden_size, generator=gen)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.1
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"],
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))


@pytest.fixture(scope="module")
def deployment(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    folder = tmp_path_factory.mktemp("adapters") / "sql"
    write_peft_adapter(folder, preset("tiny-random"))
    worker = WorkerConfig(
        worker_id="template",
        num_blocks=128,
        device=TEST_DEVICE,
        lora_adapters=(("sql", str(folder)),),
    )
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(port=0, block_size=16), num_workers=2, worker=worker
    )
    d = Deployment(config)
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def stub(deployment: Deployment) -> Iterator[pb_grpc.KVMeshStub]:
    channel = grpc.insecure_channel(deployment.address)
    yield pb_grpc.KVMeshStub(channel)
    channel.close()


def _served(stub: pb_grpc.KVMeshStub) -> bool:
    workers = stub.ListWorkers(pb.ListWorkersRequest()).workers
    return len(workers) == 2 and all(list(w.adapters) == ["sql"] for w in workers)


def _matched(stub: pb_grpc.KVMeshStub, worker: str, **kw: object) -> int:
    matches = stub.Lookup(pb.LookupRequest(token_ids=PROMPT, **kw)).matches
    return next((m.matched_blocks for m in matches if m.worker_id == worker), 0)


def test_an_adapters_blocks_are_its_own_in_the_index_and_the_pool(
    stub: pb_grpc.KVMeshStub,
) -> None:
    wait_for(lambda: _served(stub), 10, "workers advertising the adapter")
    first = generate(stub, PROMPT, adapter="sql", worker_id="w0")
    assert first[0].cache.computed_tokens == len(PROMPT)
    wait_for(lambda: _matched(stub, "w0", adapter="sql") == 4, 10, "the adapter's blocks")
    assert _matched(stub, "w0") == 0  # the base model's chain differs from the first block
    again = generate(stub, PROMPT, adapter="sql")
    assert again[0].cache.worker_id == "w0" and again[0].cache.cached_tokens == 64
    base = generate(stub, PROMPT, worker_id="w0")
    assert base[0].cache.cached_tokens == 0
    tokens = [t for r in first for t in r.token_ids]
    assert tokens == [t for r in again for t in r.token_ids]
    assert tokens != [t for r in base for t in r.token_ids]  # the adapter changes the model


def test_an_unknown_adapter_is_refused_as_invalid(stub: pb_grpc.KVMeshStub) -> None:
    wait_for(lambda: _served(stub), 10, "workers advertising the adapter")
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, PROMPT, adapter="law")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no worker serves adapter 'law'; served: ['sql']" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Route(pb.RouteRequest(token_ids=PROMPT, adapter="law"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_media_items_steer_route_and_lookup_and_generate_refuses_them(
    stub: pb_grpc.KVMeshStub,
) -> None:
    image = pb.MediaItem(hash=0xCA7, offset=40, length=20)  # blocks 2 and 3 of 16 tokens
    other = pb.MediaItem(hash=0xD06, offset=40, length=20)
    a = stub.Lookup(pb.LookupRequest(token_ids=PROMPT, media=[image]))
    b = stub.Lookup(pb.LookupRequest(token_ids=PROMPT, media=[other]))
    assert a.block_hashes[:2] == b.block_hashes[:2] and a.block_hashes[2] != b.block_hashes[2]
    generate(stub, PROMPT, worker_id="w1")  # the text-only chain: blocks 0-3 on w1
    wait_for(lambda: _matched(stub, "w1") == 4, 10, "the text chain's blocks")
    assert _matched(stub, "w1", media=[image]) == 2  # held up to the image, not past it
    route = stub.Route(pb.RouteRequest(token_ids=PROMPT, media=[image]))
    assert {s.worker_id: s.matched_blocks for s in route.scores}["w1"] == 2
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, PROMPT, media=[image])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text-only" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(pb.LookupRequest(token_ids=PROMPT, media=[pb.MediaItem(hash=1, offset=60)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "offset 60 of length 0" in err.value.details()
