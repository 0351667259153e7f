"""The block-copy kernel against the slow reference (run on a CUDA machine)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.workers.transfer.block_copy import copy_blocks

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
