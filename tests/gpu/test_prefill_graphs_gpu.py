"""Long chunked prefills replayed as CUDA graphs (`prefill_graphs`): the same logits and the
same cache as the eager forward, padding rows writing nothing but the chunk's own slots, and
one graph per bucket serving every length in it."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from kvmesh.workers.kv.layer_writes import LayerGroups
from kvmesh.workers.model import batch_plan
from kvmesh.workers.model.cudnn_pages import cudnn_pages_usable
from kvmesh.workers.model.runner import PREFILL_CAPTURE_TRIES, ModelRunner, SeqChunk
from tests.gpu.small_model import small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cudnn_pages_usable(torch.device("cuda")),
        reason="needs CUDA, a Hopper card and the cuDNN frontend's bindings",
    ),
]


def small_runner(monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    """A bf16 runner whose chunks of >= 16 tokens behind >= 64 go to cuDNN over the pages."""
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 64)
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_NEW", 16)
    config = dataclasses.replace(small_config(), num_layers=3)
    runner = ModelRunner(config, 400, 16, device="cuda", dtype=torch.bfloat16)
    runner.attention.mode = dataclasses.replace(
        runner.attention.mode, bucketed_prefill=True, cudnn_pages=True
    )
    assert runner.prefill_graphs
    return runner


def test_graph_replay_matches_the_eager_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = small_runner(monkeypatch)
    config = runner.config
    rng = random.Random(5)
    table = rng.sample(range(1, 300), 100)  # blocks 300-399 and 0 stay unused: must stay zero
    ids = [rng.randrange(config.vocab_size) for _ in range(1500)]
    runner.forward([SeqChunk(ids[:700], 0, table)])
    # 300 and 280 new tokens: one bucket (512 rows), padding rows in both; 700 new: another,
    # captured between them (the first bucket's graph replays after a bigger one was made)
    for start, n in ((700, 300), (700, 700), (700, 280)):
        chunk = SeqChunk(ids[start : start + n], start, table)
        runner.prefill_graphs = True
        graphed = runner.forward([chunk])
        cache_graphed = runner.kv_cache.clone()
        runner.prefill_graphs = False
        eager = runner.forward([chunk])
        torch.testing.assert_close(graphed, eager, atol=0.05 * eager.abs().max().item(), rtol=0)
        cosine = torch.nn.functional.cosine_similarity(graphed.flatten(), eager.flatten(), dim=0)
        assert cosine.item() > 0.999
        # the eager step rewrote the same slots: the graph left the same K/V there
        scale = cache_graphed.abs().max().item()
        assert (runner.kv_cache - cache_graphed).abs().max().item() <= 0.02 * scale
    assert runner.kv_cache[:, :, 300:].eq(0).all() and runner.kv_cache[:, :, 0].eq(0).all()
    graphs = runner._prefill_graphs
    assert graphs is not None and len(graphs.buckets) == 2
    graphs.check_invariants()


def test_blocks_in_aligned_runs_replay_the_graph_of_longer_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same chunk over the same blocks, read as 64-token pages (the blocks lie in runs of
    four, starting anywhere) or one block a page: the same logits, eager and replayed."""
    runner = small_runner(monkeypatch)
    rng = random.Random(9)
    starts = rng.sample(range(2, 396, 5), 25)
    table = [s + i for s in starts for i in range(4)]  # 100 blocks, 25 runs, block 0 unused
    ids = [rng.randrange(runner.config.vocab_size) for _ in range(1500)]
    runner.forward([SeqChunk(ids[:700], 0, table)])
    chunk = [SeqChunk(ids[700:1000], 700, table)]
    logits = {}
    for runs in (True, False):
        runner.page_runs = runs
        for graphs in (True, False):
            runner.prefill_graphs = graphs
            logits[runs, graphs] = runner.forward(chunk)
    want = logits[False, False]
    for got in logits.values():
        torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)
    graphs = runner._prefill_graphs
    assert graphs is not None
    assert sorted(b.page_blocks for b in graphs.buckets) == [1, 4]
    reads = runner.page_reads  # two forwards over runs (graph, eager), two one block a page
    assert (reads.num_chunks, reads.num_run_chunks) == (4, 2)
    assert runner.kv_cache[:, :, 0].eq(0).all()  # padding pages point at page 0: never written
    graphs.check_invariants()


def test_a_short_chunk_alone_in_its_step_replays_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """A local hit with a short question (`SOLE_CHUNK_MIN_NEW` new tokens and up): cuDNN over the
    pages and a graph of 64 rows, the same logits and cache as the paged kernel's eager step; a
    shorter chunk, or one beside another, stays on the paged kernel."""
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 64)
    config = dataclasses.replace(small_config(), num_layers=3)
    runner = ModelRunner(config, 400, 16, device="cuda", dtype=torch.bfloat16)
    runner.attention.mode = dataclasses.replace(
        runner.attention.mode, bucketed_prefill=True, cudnn_pages=True
    )
    graphs = runner._prefill_graphs
    assert graphs is not None
    rng = random.Random(13)
    table = rng.sample(range(1, 300), 60)
    ids = [rng.randrange(config.vocab_size) for _ in range(760)]
    runner.forward([SeqChunk(ids[:700], 0, table)])
    n = batch_plan.SOLE_CHUNK_MIN_NEW
    for new in (n, n + 30):
        chunk = SeqChunk(ids[700 : 700 + new], 700, table)
        runner.prefill_graphs = True
        replays = graphs.counts().num_replays
        graphed = runner.forward([chunk])
        assert graphs.counts().num_replays == replays + 1
        cache_graphed = runner.kv_cache.clone()
        runner.prefill_graphs = False
        paged = dataclasses.replace(runner.attention.mode, cudnn_pages=False)
        runner.attention.mode, mode = paged, runner.attention.mode
        eager = runner.forward([chunk])
        runner.attention.mode = mode
        torch.testing.assert_close(graphed, eager, atol=0.05 * eager.abs().max().item(), rtol=0)
        scale = cache_graphed.abs().max().item()
        assert (runner.kv_cache - cache_graphed).abs().max().item() <= 0.02 * scale
    runner.prefill_graphs = True
    replays = graphs.counts().num_replays
    runner.forward([SeqChunk(ids[700 : 700 + n - 1], 700, table)])  # too short: eager
    assert graphs.counts().num_replays == replays


def hit_behind_prefix(
    runner: ModelRunner, seed: int
) -> tuple[random.Random, list[int], list[int], torch.Tensor]:
    """A 600-token prefix computed into 60 scattered blocks below 150, and the eager logits of
    the 300 tokens after it read from there: (rng, those blocks, the token ids, the logits)."""
    rng = random.Random(seed)
    source = rng.sample(range(1, 150), 60)
    ids = [rng.randrange(runner.config.vocab_size) for _ in range(900)]
    runner.forward([SeqChunk(ids[:600], 0, source)])
    runner.prefill_graphs = False
    expected = runner.forward([SeqChunk(ids[600:], 600, source)])
    return rng, source, ids, expected


def test_a_pulled_prefix_still_landing_is_waited_for_before_the_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = small_runner(monkeypatch)
    rng, source, ids, expected = hit_behind_prefix(runner, 9)
    target = rng.sample(range(150, 300), 60)
    cache, pulled = runner.kv_cache, -(-600 // 16)

    def write(lo: int, hi: int) -> None:  # a peer's pull of the prefix, slow on the GPU
        torch.cuda._sleep(50_000_000)
        cache[lo:hi, :, target[:pulled]] = cache[lo:hi, :, source[:pulled]]

    groups = LayerGroups([(0, 1), (1, 3)], runner.block_io.layer_stream(), target[:pulled], write)
    assert not groups.overlaps_forward and not groups.gated
    runner.block_io.add_layer_writes(groups)
    runner.prefill_graphs = True
    graphs = runner._prefill_graphs
    assert graphs is not None
    got = runner.forward([SeqChunk(ids[600:], 600, target)])
    runner.block_io.take_layer_writes()
    assert graphs.counts().num_replays == 1
    torch.testing.assert_close(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0)


def test_a_pulled_prefix_with_gates_is_waited_for_layer_by_layer_inside_the_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = small_runner(monkeypatch)
    assert runner.block_io.layer_gates is not None
    rng, source, ids, expected = hit_behind_prefix(runner, 13)
    cache, pulled = runner.kv_cache, -(-600 // 16)
    runner.prefill_graphs = True
    graphs = runner._prefill_graphs
    assert graphs is not None
    # Twice into fresh blocks: the first forward captures the bucket, the second replays it while
    # the later group still sleeps on the side stream, so only the gates inside the graph keep
    # layers 1 and 2 from reading blocks not written yet (nothing waits for the pull up front).
    for round_, lo in enumerate((150, 225)):
        target = rng.sample(range(lo, lo + 75), 60)
        cache[:, :, target] = 0

        def write(lo: int, hi: int, target: list[int] = target) -> None:
            if lo > 0:
                torch.cuda._sleep(100_000_000)
            cache[lo:hi, :, target[:pulled]] = cache[lo:hi, :, source[:pulled]]

        groups = LayerGroups(
            [(0, 1), (1, 3)],
            runner.block_io.layer_stream(),
            target[:pulled],
            write,
            runner.block_io.layer_gates,
        )
        assert groups.gated and not groups.overlaps_forward
        runner.block_io.add_layer_writes(groups)
        got = runner.forward([SeqChunk(ids[600:], 600, target)])
        assert graphs.counts().num_replays == round_ + 1
        for writes in runner.block_io.take_layer_writes():
            writes.done.synchronize()
        torch.testing.assert_close(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("kernel_only", [False, True])
def test_a_promotion_still_landing_is_waited_for_layer_by_layer_inside_the_replay(
    monkeypatch: pytest.MonkeyPatch, kernel_only: bool
) -> None:
    runner = small_runner(monkeypatch)
    rng, source, ids, expected = hit_behind_prefix(runner, 11)
    num_promoted = -(-600 // 16)
    host = (
        runner.block_io.export_blocks(source[:num_promoted]).cpu().pin_memory()
    )  # the host tier's layout
    runner.prefill_graphs = True
    graphs = runner._prefill_graphs
    assert graphs is not None
    # Twice into fresh blocks: the first forward captures the bucket (its eager warm-up waits for
    # the load), the second replays it while the load still lands behind a long sleep, so only the
    # gates inside the graph keep its layers from reading blocks not written yet.
    for round_, lo in enumerate((150, 225)):
        target = rng.sample(range(lo, lo + 75), 60)
        runner.kv_cache[:, :, target] = 0
        with torch.cuda.stream(runner.block_io.layer_stream()):
            torch.cuda._sleep(100_000_000)
        load = runner.block_io.load_layers(
            host, list(range(num_promoted)), target[:num_promoted], kernel_only=kernel_only
        )
        assert load.gated and load.uses_copy_engine == (
            not kernel_only and runner.block_io.copy_engine is not None
        )
        got = runner.forward([SeqChunk(ids[600:], 600, target)])
        assert graphs.counts().num_replays == round_ + 1
        for writes in runner.block_io.take_layer_writes():
            writes.done.synchronize()
        torch.testing.assert_close(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0)


def test_a_failed_capture_runs_its_chunk_eagerly_once_and_the_next_one_captures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = small_runner(monkeypatch)
    rng = random.Random(9)
    table = rng.sample(range(1, 300), 100)
    ids = [rng.randrange(runner.config.vocab_size) for _ in range(1000)]
    runner.forward([SeqChunk(ids[:700], 0, table)])
    graphs = runner._prefill_graphs
    assert graphs is not None
    replay = graphs._graphs.replay
    refusals = [1]

    def refuse(*args: Any) -> Any:  # what a kernel compiled inside a capture raises
        if refusals:
            refusals.pop()
            raise RuntimeError("operation not permitted when stream is capturing")
        return replay(*args)

    monkeypatch.setattr(graphs._graphs, "replay", refuse)
    chunk = SeqChunk(ids[700:], 700, table)
    before = runner.page_reads.num_chunks
    eager = runner.forward([chunk])
    assert runner.page_reads.num_chunks == before + 1  # counted once, by the eager path
    assert runner.prefill_graphs and runner.num_failed_prefill_captures == 1
    replays = graphs.counts().num_replays
    graphed = runner.forward([chunk])  # the next try captures
    assert graphs.counts().num_replays == replays + 1
    torch.testing.assert_close(graphed, eager, atol=0.05 * eager.abs().max().item(), rtol=0)
    # captures that keep failing: eager for good after PREFILL_CAPTURE_TRIES of them
    refusals.extend([1] * (PREFILL_CAPTURE_TRIES - 1))
    for _ in range(PREFILL_CAPTURE_TRIES - 1):
        assert runner.prefill_graphs
        runner.forward([chunk])
    assert not runner.prefill_graphs
    assert runner.num_failed_prefill_captures == PREFILL_CAPTURE_TRIES
