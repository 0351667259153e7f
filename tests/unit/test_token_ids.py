"""A prompt's token ids as one uint32 buffer: the same ids as the list it was made from (equal,
sliced, joined, hashed like the tuple), refused when an id is no uint32, and pickled as its
bytes, which is how a worker request carries them."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from kvmesh.proto.block_hash import block_hashes
from kvmesh.proto.token_ids import TokenIds, token_ids_of
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest

IDS = [0, 7, 2**32 - 1, 128_000, 3]


@pytest.mark.parametrize(
    "source",
    [IDS, tuple(IDS), np.array(IDS, dtype=np.uint32), np.array(IDS, dtype=np.int64), iter(IDS)],
)
def test_made_from_any_form_of_the_ids_it_is_those_ids(source: object) -> None:
    ids = TokenIds(source)  # type: ignore[arg-type]
    assert ids == IDS and ids == tuple(IDS) and list(ids) == IDS and ids.tolist() == IDS
    assert len(ids) == len(IDS) and ids[2] == 2**32 - 1 and ids[-1] == 3
    assert all(type(t) is int for t in ids)
    assert hash(ids) == hash(tuple(IDS))
    assert ids != IDS[:-1] and ids != [*IDS[:-1], 4]


@pytest.mark.parametrize(
    "bad",
    [[1, -1], [2**32], [1.5], ["7"], np.array([1, -2]), np.array([0.5]), np.zeros((2, 2), int)],
)
def test_an_id_that_is_no_uint32_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="token ids must"):
        TokenIds(bad)  # type: ignore[arg-type]


def test_bytes_and_text_are_not_taken_for_ids() -> None:
    for bad in (b"\x01\x00\x00\x00", "abcd"):
        with pytest.raises(ValueError, match="must be integers"):
            TokenIds(bad)  # type: ignore[arg-type]


def test_slices_and_sums_are_token_ids_of_the_same_values() -> None:
    ids = TokenIds(IDS)
    assert ids[1:4] == IDS[1:4] and isinstance(ids[1:4], TokenIds)
    assert ids[::-1] == IDS[::-1]
    assert ids + (9, 10) == [*IDS, 9, 10] and ids + [] == ids
    assert token_ids_of(ids) is ids and token_ids_of(IDS) == ids


def test_its_array_is_read_only_so_the_ids_never_change() -> None:
    ids = TokenIds(IDS)
    with pytest.raises(ValueError):
        ids.array[0] = 5
    assert ids == IDS
    source = np.array(IDS, dtype=np.uint32)
    copied = TokenIds(source)
    source[0] = 99  # the caller's array is copied, not shared
    assert copied == IDS


def test_it_hashes_as_its_list_and_is_its_own_uint32_array() -> None:
    prompt = list(range(100, 150))
    ids = TokenIds(prompt)
    assert block_hashes(ids, 16, 5) == block_hashes(prompt, 16, 5)
    assert block_hashes(ids.array[16:48], 16, 5) == block_hashes(prompt[16:48], 16, 5)
    assert ids.array.dtype == np.uint32 and ids.array.tolist() == prompt


def test_a_worker_request_pickles_its_prompt_as_four_bytes_a_token() -> None:
    prompt = TokenIds(range(100_000, 108_192))  # ids a 128K vocabulary has
    request = WorkerRequest("r", prompt, SamplingConfig(max_tokens=4))
    data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(data) < 4 * len(prompt) + 1024
    back = pickle.loads(data)
    assert back == request and back.prompt_ids == prompt
    as_tuple = WorkerRequest("r", tuple(prompt), SamplingConfig(max_tokens=4))
    assert len(pickle.dumps(as_tuple, protocol=pickle.HIGHEST_PROTOCOL)) > len(data)
