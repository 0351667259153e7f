"""Layered writes on the GPU: a forward over blocks that are still being written on a side stream
(a pull's layer groups) waits for each group and gives the logits of blocks written beforehand."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from kvmesh.workers.kv.layer_writes import LayerGroups, group_spans
from kvmesh.workers.model.runner import ModelRunner, SeqChunk
from kvmesh.workers.model.weights import random_weights
from kvmesh.workers.transfer.block_copy import copy_blocks
from tests.gpu.small_model import small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BS = 16
SLOW_CYCLES = 50_000_000  # ~25 ms of GPU sleep before a group lands: far longer than the forward


def slow_copy(
    cache: torch.Tensor, dst: list[int], src: list[int], landed: list[tuple[int, int]] | None = None
) -> Callable[[int, int], None]:
    """A layer group's write that sleeps on the GPU before copying blocks `src` to `dst`."""

    def write(lo: int, hi: int) -> None:
        torch.cuda._sleep(SLOW_CYCLES)
        copy_blocks(cache[lo:hi], dst, cache[lo:hi], src)
        if landed is not None:
            landed.append((lo, hi))

    return write


@pytest.mark.parametrize("num_groups", [1, 2, 4])
def test_a_forward_waits_for_each_layer_group_it_reads(num_groups: int) -> None:
    config = small_config()
    weights = random_weights(config, seed=0, device="cuda", dtype=torch.float32)
    runner = ModelRunner(config, 64, BS, device="cuda", dtype=torch.float32, weights=weights)
    rng = random.Random(7)
    ids = [rng.randrange(256) for _ in range(8 * BS + 5)]
    source, target = list(range(8)) + [20], list(range(30, 38)) + [21]
    runner.forward([SeqChunk(ids[: 8 * BS], 0, source[:8])])
    expected = runner.forward([SeqChunk(ids[8 * BS :], 8 * BS, source)])
    landed: list[tuple[int, int]] = []
    write = slow_copy(runner.kv_cache, target[:8], source[:8], landed)
    spans = group_spans(config.num_layers, num_groups)
    groups = LayerGroups(spans, runner.block_io.layer_stream(), target[:8], write)
    runner.block_io.add_layer_writes(groups)
    # Queued while the copy sleeps: without the waits it would read the target blocks unwritten.
    got = runner.forward([SeqChunk(ids[8 * BS :], 8 * BS, target)])
    for writes in runner.block_io.take_layer_writes():
        writes.done.synchronize()
    assert landed == spans
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_runner_settles_its_layered_writes_before_a_peer_reads_them() -> None:
    config = small_config()
    runner = ModelRunner(config, 16, BS, device="cuda", dtype=torch.float32)
    cache = runner.kv_cache
    cache[:, :, 0].fill_(1.0)
    write = slow_copy(cache, [5], [0])
    groups = LayerGroups([(0, config.num_layers)], runner.block_io.layer_stream(), [5], write)
    runner.block_io.add_layer_writes(groups)
    runner.block_io.settle_layer_writes([3, 5])
    assert groups.done.query()
    assert torch.equal(cache[:, :, 5].cpu(), torch.ones_like(cache[:, :, 5]).cpu())


def test_a_copy_out_of_the_cache_waits_for_the_blocks_still_landing() -> None:
    # A host-tier demotion or an export reads blocks on the engine's stream.
    config = small_config()
    runner = ModelRunner(config, 16, BS, device="cuda", dtype=torch.float32)
    runner.kv_cache[:, :, 0].fill_(2.0)
    write = slow_copy(runner.kv_cache, [7], [0])
    runner.block_io.add_layer_writes(
        LayerGroups([(0, 2), (2, 4)], runner.block_io.layer_stream(), [7], write)
    )
    out = runner.block_io.export_blocks([7])
    assert torch.equal(out.cpu(), torch.full_like(out, 2.0).cpu())


def test_a_decode_graph_captured_behind_a_layered_write_waits_for_it() -> None:
    # A pulled prompt whose last token is all that is left runs as a decode-shaped step; its
    # bucket's graph may be captured right then, with the pull's groups still pending.
    config = small_config()
    weights = random_weights(config, seed=0, device="cuda", dtype=torch.float32)
    runner = ModelRunner(config, 64, BS, device="cuda", dtype=torch.float32, weights=weights)
    assert runner.cuda_graphs
    rng = random.Random(8)
    ids = [rng.randrange(256) for _ in range(8 * BS + 1)]
    source, target = list(range(8)) + [20], list(range(30, 38)) + [21]
    runner.cuda_graphs = False
    runner.forward([SeqChunk(ids[: 8 * BS], 0, source[:8])])
    expected = runner.forward([SeqChunk(ids[8 * BS :], 8 * BS, source)])
    write = slow_copy(runner.kv_cache, target[:8], source[:8])
    groups = LayerGroups([(0, 2), (2, 4)], runner.block_io.layer_stream(), target[:8], write)
    runner.block_io.add_layer_writes(groups)
    runner.cuda_graphs = True  # the first decode-shaped step captures its bucket now
    got = runner.forward([SeqChunk(ids[8 * BS :], 8 * BS, target)])
    for writes in runner.block_io.take_layer_writes():
        writes.done.synchronize()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
