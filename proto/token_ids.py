"""A prompt's token ids as one immutable uint32 buffer.

This is the form a prompt takes from the coordinator's handler to a worker's sequence: the
handler reads a request message's ids into it once, the coordinator hashes and routes it, the
request carries it to the worker (pickled as its 4 bytes per token, not as thousands of Python
ints: for an 8K prompt ~0.3 ms less each way on the CPU box), and the worker checks, hashes
and slices it without converting it again. A tuple of 8K ints is also 8K objects for the
garbage collector to walk; this is one.

    TokenIds([5, 9, 2])   ->  _data: 05 00 00 00 | 09 00 00 00 | 02 00 00 00   (native uint32)
                              array: a read-only numpy view of _data
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

_MAX_ID = 0xFFFFFFFF
assert array.array("I").itemsize == 4, "uint32 arrays must be 4 bytes wide"


class TokenIds(Sequence[int]):
    """Invariant: `_data` never changes (bytes), and `array` is a read-only uint32 view of it,
    so a `TokenIds` equals what it was made from for as long as it lives."""

    __slots__ = ("_array", "_data")
    _data: bytes
    _array: np.ndarray

    def __init__(self, values: Iterable[int] | np.ndarray = ()) -> None:
        """From another `TokenIds` (shared, no copy), a numpy array of integers (one copy) or
        any iterable of ints. Raises ValueError for an id that is not an int in [0, 2**32)."""
        if isinstance(values, TokenIds):
            data: bytes = values._data
        elif isinstance(values, np.ndarray):
            data = _array_bytes(values)
        elif isinstance(values, str | bytes | bytearray | memoryview):
            raise ValueError(f"token ids must be integers, got {type(values).__name__}")
        else:
            try:
                data = array.array("I", values).tobytes()
            except (OverflowError, TypeError):
                raise ValueError("token ids must be uint32 integers, in [0, 2**32)") from None
        self._data = data
        self._array = np.frombuffer(data, dtype=np.uint32)

    @classmethod
    def _from_bytes(cls, data: bytes) -> TokenIds:
        ids = cls.__new__(cls)
        ids._data = data
        ids._array = np.frombuffer(data, dtype=np.uint32)
        return ids

    @property
    def array(self) -> np.ndarray:
        """The ids as a read-only uint32 array (no copy)."""
        return self._array

    def tobytes(self) -> bytes:
        """The ids as native-endian uint32 bytes (no copy)."""
        return self._data

    def tolist(self) -> list[int]:
        return self._array.tolist()  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return int(self._array.size)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...
    def __getitem__(self, index: int | slice) -> int | TokenIds:
        if isinstance(index, slice):
            return TokenIds(self._array[index])
        return int(self._array[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self._array.tolist())

    def __add__(self, other: Iterable[int]) -> TokenIds:
        return TokenIds(np.concatenate((self._array, TokenIds(other)._array)))

    def __eq__(self, other: object) -> bool:
        """Equal to a `TokenIds`, tuple or list of the same ids (as a tuple equals a tuple)."""
        if isinstance(other, TokenIds):
            return self._data == other._data
        if isinstance(other, tuple | list):
            return len(other) == len(self) and self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.tolist()))  # as the equal tuple hashes

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (TokenIds._from_bytes, (self._data,))

    def __repr__(self) -> str:
        n = len(self)
        if n <= 8:
            return f"TokenIds({self.tolist()})"
        head = ", ".join(str(t) for t in self._array[:4].tolist())
        return f"TokenIds([{head}, ...] {n} ids)"


def token_ids_of(values: Sequence[int] | np.ndarray) -> TokenIds:
    """`values` as `TokenIds` (itself if it already is one)."""
    return values if isinstance(values, TokenIds) else TokenIds(values)


def _array_bytes(values: np.ndarray) -> bytes:
    if values.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {values.shape}")
    if values.dtype == np.uint32:
        return values.tobytes()
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got {values.dtype}")
    if values.size and (int(values.min()) < 0 or int(values.max()) > _MAX_ID):
        raise ValueError("token ids must be uint32 integers, in [0, 2**32)")
    return values.astype(np.uint32).tobytes()
