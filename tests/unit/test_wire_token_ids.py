"""The client's token ids check: every id a uint32, the first bad one named, nothing else
changed on the way to the wire."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.client.wire import MAX_UINT32, checked_token_ids


def test_valid_ids_come_back_as_python_ints_in_order() -> None:
    ids = checked_token_ids(np.array([5, 0, MAX_UINT32], dtype=np.int64))
    assert ids == [5, 0, MAX_UINT32]
    assert all(type(t) is int for t in ids)
    assert checked_token_ids([]) == []


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([3, 4, -1, -7], r"token_ids\[2\] = -1 is outside"),
        ([3, MAX_UINT32 + 1, 5], rf"token_ids\[1\] = {MAX_UINT32 + 1} is outside"),
    ],
)
def test_the_first_id_out_of_range_is_named(ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checked_token_ids(ids)


def test_a_non_integer_id_is_refused() -> None:
    with pytest.raises(TypeError):
        checked_token_ids([1, 2.0])
