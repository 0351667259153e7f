"""A prompt's token ids as the simulator hands them to the coordinator: their number only."""

from __future__ import annotations

from collections.abc import Iterator


class UnreadTokens(tuple[int, ...]):
    """A prompt's token ids as the simulator hands them to the coordinator: their number only.

    The simulated workers never read token ids (the hashes stand for them), and the coordinator
    reads only their count on the simulated path; a real tuple of N Python ints per request
    cost the run about 0.1 ms per request in garbage collection alone (each new tuple is
    traversed whole). Reading the ids raises instead of yielding nothing."""

    num_tokens: int

    def __new__(cls, num_tokens: int) -> UnreadTokens:
        tokens = super().__new__(cls)
        tokens.num_tokens = num_tokens
        return tokens

    def __len__(self) -> int:
        return self.num_tokens

    def __iter__(self) -> Iterator[int]:
        raise TypeError("the simulator hands the coordinator a prompt's length, not its tokens")
