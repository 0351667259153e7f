"""A client's channel settings and auth metadata are checked before a channel opens
(`client/channel_options.py`)."""

from __future__ import annotations

import pytest

from kvmesh.client.channel_options import auth_metadata, channel_options


def test_a_token_travels_as_a_bearer_header_and_none_sends_nothing() -> None:
    assert auth_metadata("t0k") == (("authorization", "Bearer t0k"),)
    assert auth_metadata(None) == ()
    for bad in ("", "two words", "tab\there", "nl\n"):
        with pytest.raises(ValueError, match="token must be"):
            auth_metadata(bad)


def test_channel_options_carry_the_message_limit_both_ways() -> None:
    assert channel_options("h:1", None, 4096) == [
        ("grpc.max_send_message_length", 4096),
        ("grpc.max_receive_message_length", 4096),
    ]
    with pytest.raises(ValueError, match="address must be a non-empty HOST:PORT"):
        channel_options(" h:1", None, 4096)
    with pytest.raises(ValueError, match="timeout_s must be > 0 or None, got 0"):
        channel_options("h:1", 0, 4096)
    with pytest.raises(ValueError, match="max_message_bytes must be >= 1024, got 10"):
        channel_options("h:1", 1.0, 10)
