"""The decision log's side of the coordinators' Redis client (`IndexStore` is one): commits by
compare-and-set, reads, and where the log ends. The log itself is `routing/decision_log.py`."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from kvmesh.coordinator.routing.decision_log import CommitResult
from kvmesh.proto import redis_schema as schema
from kvmesh.proto.placements import (
    Placement,
    PlacementDecodeError,
    decode_placement,
    encode_placement,
)

log = logging.getLogger(__name__)

# The decision log's compare-and-set (`routing/decision_log.py`): KEYS[1] the sequence, KEYS[2]
# the stream; ARGV[1] the expected sequence (-1: append whatever it is), ARGV[2] the entry,
# ARGV[3] the stream's length cap, ARGV[4] the most entries a lost commit returns.
# Returns {1, seq} when appended as entry `seq`; else {0, seq, entries after the expected one}.
COMMIT_DECISION = """
local seq = tonumber(redis.call('GET', KEYS[1]) or '0')
local expected = tonumber(ARGV[1])
if expected < 0 or expected == seq then
  seq = seq + 1
  redis.call('SET', KEYS[1], seq)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], seq .. '-0', 'd', ARGV[2])
  return {1, seq}
end
if expected > seq then
  return {0, seq, {}}
end
return {0, seq, redis.call('XRANGE', KEYS[2], (expected + 1) .. '-0', '+', 'COUNT', ARGV[4])}
"""
_MAX_MISSED = 10_000


class DecisionLogStore:
    """The decision log's calls, on the client and the registered `COMMIT_DECISION` script of
    the class it is mixed into."""

    _client: Any
    _commit_decision: Any
    num_decode_errors: int

    def commit_decision(self, expected_seq: int | None, placement: Placement) -> CommitResult:
        """Append `placement` to the decision log if it ends at `expected_seq` (None: anyway);
        a lost commit returns the entries after `expected_seq` (one round trip either way)."""
        keys = [schema.DECISIONS_SEQ_KEY, schema.DECISIONS_STREAM]
        expected = -1 if expected_seq is None else expected_seq
        entry = encode_placement(placement)
        args: list[bytes | int] = [expected, entry, schema.DECISIONS_STREAM_MAXLEN, _MAX_MISSED]
        reply = self._commit_decision(keys=keys, args=args)
        if int(reply[0]) == 1:
            return CommitResult(True, int(reply[1]))
        return CommitResult(False, int(reply[1]), tuple(self._decisions(reply[2])))

    def decision_seq(self) -> int:
        """Where the decision log ends now."""
        return int(self._client.get(schema.DECISIONS_SEQ_KEY) or 0)

    def read_decisions(self, after_seq: int, block_ms: int | None) -> list[tuple[int, Placement]]:
        """The log's entries after `after_seq`, waiting up to block_ms for the first."""
        reply = self._client.xread(
            {schema.DECISIONS_STREAM: f"{after_seq}-0"}, count=512, block=block_ms
        )
        return [e for _, entries in reply or [] for e in self._decisions(entries)]

    def _decisions(self, entries: Any) -> Iterator[tuple[int, Placement]]:
        for entry_id, fields in entries:
            raw = fields[b"d"] if isinstance(fields, dict) else dict(_pairs(fields))[b"d"]
            seq = int(entry_id.decode().partition("-")[0])
            try:
                yield seq, decode_placement(raw)
            except PlacementDecodeError as exc:
                self.num_decode_errors += 1
                log.warning("rejected decision %s: %s", seq, exc)


def _pairs(flat: Sequence[Any]) -> Iterator[tuple[Any, Any]]:
    """A Lua-returned stream entry's fields ([k1, v1, k2, v2, ...]) as pairs."""
    return zip(flat[::2], flat[1::2], strict=True)
