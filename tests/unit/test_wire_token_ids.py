"""The client's token ids check: every id a uint32, the first bad one named, nothing else
changed on the way to the wire (the check alone, and a request built with it)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.client.wire import MAX_UINT32, checked_token_ids
from tests.unit.generate_args import generate_args


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


def _request(token_ids: object) -> list[int]:
    from kvmesh.client.wire import build_generate_request

    request = build_generate_request(token_ids, **generate_args(max_tokens=2))  # type: ignore[arg-type]
    return list(request.token_ids)


@pytest.mark.parametrize(
    "ids",
    [
        [7, 0, MAX_UINT32],
        (7, 0, MAX_UINT32),
        np.array([7, 0, MAX_UINT32]),
        iter([7, 0, MAX_UINT32]),
    ],
)
def test_a_request_carries_the_ids_as_given(ids: object) -> None:
    assert _request(ids) == [7, 0, MAX_UINT32]


def test_a_request_takes_bools_as_ids_as_the_check_does() -> None:
    assert _request([True, False, 3]) == [1, 0, 3]


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        ([3, 4, -1, -7], ValueError, r"token_ids\[2\] = -1 is outside"),
        (np.array([1, MAX_UINT32 + 1]), ValueError, rf"token_ids\[1\] = {MAX_UINT32 + 1} is"),
        ([1, 2.0], TypeError, "float"),
        ([], ValueError, "token_ids is empty"),
    ],
)
def test_a_request_with_a_bad_id_names_it(ids: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _request(ids)
