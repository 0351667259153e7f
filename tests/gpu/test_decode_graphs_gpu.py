"""Decode through CUDA graphs gives the eager path's tokens and logits, and its padding never
writes outside the batch's blocks."""

from __future__ import annotations

import random

import pytest
import torch

from kvmesh.workers.model.decode_graphs import DecodeBucket
from kvmesh.workers.model.runner import ModelRunner, SeqChunk
from kvmesh.workers.model.weights import random_weights
from tests.gpu.small_model import small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_BLOCKS = 1024
BS = 16


def pair(dtype: torch.dtype) -> tuple[ModelRunner, ModelRunner]:
    """(graphs, eager) runners on the same weights, each with its own cache."""
    config = small_config()
    weights = random_weights(config, seed=0, device="cuda", dtype=dtype)
    graphs, eager = (
        ModelRunner(config, NUM_BLOCKS, BS, device="cuda", dtype=dtype, weights=weights)
        for _ in range(2)
    )
    assert graphs.cuda_graphs
    eager.cuda_graphs = False
    return graphs, eager


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(20, 700))] for _ in range(n)]


def tables(n: int, seed: int) -> list[list[int]]:
    """Disjoint random tables of 48 blocks (768 positions) per sequence."""
    ids = random.Random(seed).sample(range(NUM_BLOCKS), 48 * n)
    return [ids[48 * i : 48 * (i + 1)] for i in range(n)]


def greedy(
    runner: ModelRunner, ids: list[list[int]], tabs: list[list[int]], steps: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt, then decode `steps` greedy tokens as one batch a step."""
    last = runner.forward([SeqChunk(p, 0, t) for p, t in zip(ids, tabs, strict=True)])
    tokens = [[int(x)] for x in last.argmax(-1).tolist()]
    logits = []
    for step in range(steps):
        batch = [
            SeqChunk([tok[-1]], len(p) + step, t)
            for p, t, tok in zip(ids, tabs, tokens, strict=True)
        ]
        out = runner.forward(batch)
        logits.append(out)
        for tok, x in zip(tokens, out.argmax(-1).tolist(), strict=True):
            tok.append(int(x))
    return tokens, logits


@pytest.mark.parametrize("num_seqs", [1, 3, 8, 13])
def test_graphs_give_the_eager_greedy_tokens_in_fp32(num_seqs: int) -> None:
    graphs, eager = pair(torch.float32)
    ids, tabs = prompts(num_seqs, seed=num_seqs), tables(num_seqs, seed=num_seqs)
    got_tokens, got_logits = greedy(graphs, ids, tabs, steps=12)
    want_tokens, want_logits = greedy(eager, ids, tabs, steps=12)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert graphs._decode_graphs is not None and graphs._decode_graphs.buckets
    assert eager._decode_graphs is not None and not eager._decode_graphs.buckets


@pytest.mark.parametrize("num_seqs", [3, 13])
def test_steps_fed_the_last_steps_tokens_on_the_device_give_the_same_tokens(
    num_seqs: int,
) -> None:
    graphs, eager = pair(torch.float32)
    ids, tabs = prompts(num_seqs, seed=30 + num_seqs), tables(num_seqs, seed=30 + num_seqs)
    want, _ = greedy(eager, ids, tabs, steps=12)
    previous = graphs.forward_tokens([SeqChunk(p, 0, t) for p, t in zip(ids, tabs, strict=True)])
    got: list[list[int]] = [[] for _ in ids]
    for step in range(12):
        # every chunk says token 0: the step must read its tokens from `previous`
        batch = [SeqChunk([0], len(p) + step, t) for p, t in zip(ids, tabs, strict=True)]
        launched = graphs.forward_tokens(batch, previous=previous)
        for row, token in zip(got, previous.tolist(), strict=True):  # read behind the launch
            row.append(token)
        previous = launched
    for row, token in zip(got, previous.tolist(), strict=True):
        row.append(token)
    assert got == want
    assert graphs.decode_graph_counts().num_replays >= 11


def test_graphs_match_eager_in_bf16_at_a_bucket_size() -> None:
    graphs, eager = pair(torch.bfloat16)
    ids, tabs = prompts(8, seed=21), tables(8, seed=21)
    got_tokens, got_logits = greedy(graphs, ids, tabs, steps=8)
    want_tokens, want_logits = greedy(eager, ids, tabs, steps=8)
    assert got_tokens == want_tokens
    # Same rows, but the bucket's longer key range splits the keys differently: bf16-close.
    for got, want in zip(got_logits, want_logits, strict=True):
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() < 0.02 * scale
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert cosine.item() > 0.9999


def test_one_capture_per_bucket_and_a_new_one_when_the_shape_grows() -> None:
    graphs, _ = pair(torch.bfloat16)
    ids, tabs = prompts(3, seed=5), tables(3, seed=5)
    ids = [p[:100] for p in ids]
    greedy(graphs, ids, tabs, steps=6)
    assert graphs._decode_graphs is not None
    assert graphs._decode_graphs.buckets == [DecodeBucket(4, 256)]
    one = graphs.decode_graph_counts()
    assert one.num_graphs == 1 and one.num_replays == 6
    longer = [p + [1] * 200 for p in ids]  # 300+ tokens: the 512-key bucket
    greedy(graphs, longer, tabs, steps=2)
    assert graphs._decode_graphs.buckets == [DecodeBucket(4, 256), DecodeBucket(4, 512)]
    two = graphs.decode_graph_counts()
    assert two.num_graphs == 2 and two.capture_ms > one.capture_ms  # the second one's time too
    assert two.num_replays == 8
    graphs._decode_graphs.check_invariants()


def test_switching_the_kernels_captures_again_with_the_same_tokens() -> None:
    graphs, eager = pair(torch.float32)
    ids, tabs = prompts(3, seed=9), tables(3, seed=9)
    ids = [p[:100] for p in ids]
    fused_tokens, _ = greedy(graphs, ids, tabs, steps=4)
    one = graphs.decode_graph_counts()
    graphs.fused_kv_write = False  # RoPE's kernel and two index_copy_ instead of one kernel
    apart_tokens, _ = greedy(graphs, ids, tabs, steps=4)
    two = graphs.decode_graph_counts()
    assert two.num_graphs == 1 and two.capture_ms > one.capture_ms  # the bucket captured again
    eager_tokens, _ = greedy(eager, ids, tabs, steps=4)
    assert fused_tokens == apart_tokens == eager_tokens


def test_padding_rows_never_write_outside_the_batch_blocks() -> None:
    graphs, _ = pair(torch.float32)
    ids, tabs = prompts(5, seed=9), tables(5, seed=9)  # 5 rows padded to 8
    greedy(graphs, ids, tabs, steps=1)  # prefill + the first decode step, captured
    used = sorted({b for t in tabs for b in t})
    untouched = sorted(set(range(NUM_BLOCKS)) - set(used))
    sentinel = 7.0
    graphs.kv_cache[:, :, untouched] = sentinel
    greedy_steps = [
        SeqChunk([3], len(p) + 1, t) for p, t in zip(ids, tabs, strict=True)
    ]  # a second step, replayed
    graphs.forward(greedy_steps)
    torch.cuda.synchronize()
    assert bool((graphs.kv_cache[:, :, untouched] == sentinel).all())


def test_mixed_batches_fall_back_to_eager() -> None:
    graphs, eager = pair(torch.float32)
    ids, tabs = prompts(2, seed=13), tables(2, seed=13)
    for runner in (graphs, eager):
        runner.forward([SeqChunk(ids[0], 0, tabs[0])])
    mixed = [SeqChunk([5], len(ids[0]), tabs[0]), SeqChunk(ids[1], 0, tabs[1])]
    torch.testing.assert_close(graphs.forward(mixed), eager.forward(mixed), atol=2e-4, rtol=0)
    assert graphs._decode_graphs is not None and not graphs._decode_graphs.buckets


def test_bad_block_ids_are_refused_before_any_replay() -> None:
    graphs, _ = pair(torch.float32)
    with pytest.raises(ValueError, match="block ids"):
        graphs.forward([SeqChunk([1], 5, [NUM_BLOCKS + 3])])


def test_a_bad_id_that_a_table_gains_later_is_refused_before_the_replay() -> None:
    """A row's table is copied only where it grew: the id it gains when its sequence crosses
    into a new block is checked then, and the same table's steps after it still decode as the
    eager path does."""
    graphs, eager = pair(torch.float32)
    prompt = [3] * (5 * BS - 2)  # the next two positions are the last of block 4
    table = list(range(100, 105))
    for runner in (graphs, eager):
        runner.forward([SeqChunk(prompt, 0, table)])
    pos = len(prompt)
    step = [SeqChunk([7], pos, table)]
    torch.testing.assert_close(graphs.forward(step), eager.forward(step), atol=2e-4, rtol=0)
    crossing = pos + 2  # the first position of block 5: the table must gain an id
    table.append(NUM_BLOCKS + 1)
    with pytest.raises(ValueError, match=r"chunk 0: block ids span \[1025, 1025\]"):
        graphs.forward([SeqChunk([7], crossing, table)])
    table[-1] = 200  # (the same list: its bad id never reached the graph's buffers)
    step = [SeqChunk([7], pos + 1, table)]
    torch.testing.assert_close(graphs.forward(step), eager.forward(step), atol=2e-4, rtol=0)
    step = [SeqChunk([8], crossing, table)]
    torch.testing.assert_close(graphs.forward(step), eager.forward(step), atol=2e-4, rtol=0)
