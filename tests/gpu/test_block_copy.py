"""The block-copy kernel against the slow reference (run on a CUDA machine)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.workers.transfer import block_copy
from kvmesh.workers.transfer.block_copy import BlockPairs, copy_block_pairs, copy_blocks
from tests.gpu.triton_variants import compiled_variants

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_copies_scattered_blocks_between_pools_of_different_sizes(
    dtype: torch.dtype,
) -> None:
    src = torch.randn(4, 2, 50, 16, 2, 64, dtype=dtype, device="cuda")
    dst = torch.zeros(4, 2, 70, 16, 2, 64, dtype=dtype, device="cuda")
    src_ids, dst_ids = [3, 49, 0, 7, 8, 9], [69, 1, 2, 40, 41, 42]
    copy_blocks(dst, dst_ids, src, src_ids)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = [i for i in range(70) if i not in dst_ids]
    assert not dst[:, :, untouched].any()


def test_pairs_reused_over_layer_groups_and_streams_copy_every_block() -> None:
    src = torch.randn(6, 2, 40, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros(6, 2, 30, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    pairs = BlockPairs([5, 39, 0, 12], [29, 3, 4, 10])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first groups on a side stream, as a pull runs them
        for lo, hi in ((0, 2), (2, 4)):
            copy_block_pairs(dst[lo:hi], src[lo:hi], pairs)
    torch.cuda.current_stream().wait_stream(side)
    copy_block_pairs(dst[4:6], src[4:6], pairs)  # the last on the default stream
    torch.cuda.synchronize()
    for s, d in zip(pairs.src_ids, pairs.dst_ids, strict=True):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    assert not dst[:, :, [i for i in range(30) if i not in pairs.dst_ids]].any()


@pytest.mark.parametrize("num_src_blocks", [50, 48])
def test_copies_of_any_count_run_one_compiled_kernel(num_src_blocks: int) -> None:
    src = torch.randn(2, 2, num_src_blocks, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros(2, 2, 33, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    copy_blocks(dst, [0], src, [0])
    before = compiled_variants(block_copy._copy_blocks_kernel)
    for n in (5, 16, 7, 1, 30):
        src_ids = list(range(num_src_blocks - 1, num_src_blocks - 1 - n, -1))
        dst_ids = [(3 + 7 * i) % 33 for i in range(n)]
        dst.zero_()
        copy_block_pairs(dst, src, BlockPairs(src_ids, dst_ids))
        torch.cuda.synchronize()
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(dst[:, :, d], src[:, :, s]), (n, s, d)
    if before is not None:
        # no block count or id alignment compiled a new one
        assert compiled_variants(block_copy._copy_blocks_kernel) == before
