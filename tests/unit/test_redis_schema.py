"""The Redis key schema: shards, hash tags and cluster URLs (pure: no Redis)."""

from __future__ import annotations

import binascii
import re

from kvmesh.proto import redis_schema as schema


def _slot(key: str) -> int:
    """Redis Cluster's slot of a key: CRC16 of its hash tag (or of the whole key)."""
    m = re.search(r"\{([^}]+)\}", key)
    return binascii.crc_hqx((m.group(1) if m else key).encode(), 0) % 16384


def test_every_key_of_one_worker_shares_its_shards_hash_tag() -> None:
    for w in ("w0", "w17", "fleet-ab12-w3", "vllm-engine-7"):
        keys = schema.purge_worker_keys(w) + [schema.feeder_key(w)]
        assert len({_slot(k) for k in keys}) == 1
        assert schema.events_key(schema.index_shard(w)) == schema.worker_events_key(w) in keys


def test_shards_sit_in_equal_slot_ranges_and_are_stable() -> None:
    width = 16384 // schema.NUM_INDEX_SHARDS
    for shard in range(schema.NUM_INDEX_SHARDS):
        assert _slot(schema.workers_key(shard)) // width == shard
    # CRC-32 of the id: the same shard in every process and run (pinned, as a wire format).
    assert [schema.index_shard(f"w{i}") for i in range(4)] == [2, 4, 14, 8]


def test_cluster_urls_are_flagged_and_the_flag_stripped() -> None:
    assert schema.cluster_url("redis://:pw@h:7000/0?cluster=1") == ("redis://:pw@h:7000/0", True)
    assert schema.cluster_url("redis://h:6379/0") == ("redis://h:6379/0", False)
    assert schema.cluster_url("rediss://h/0?ssl_cert_reqs=required&cluster=0") == (
        "rediss://h/0?ssl_cert_reqs=required",
        False,
    )


def test_a_block_value_is_its_tier_parent_and_depth_in_fixed_width() -> None:
    assert schema.block_value(1, 0xAB, 3) == "1" + "00000000000000ab" + "00000003"
    assert len(schema.block_value(0, 2**64 - 1, schema.MAX_LINK_DEPTH)) == schema.BLOCK_VALUE_LEN
    assert schema.block_value(0, 5, schema.MAX_LINK_DEPTH + 1).endswith("0" * 8)  # too deep
