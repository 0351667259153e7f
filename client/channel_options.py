"""A client's gRPC channel settings and call metadata, checked before any channel opens."""

from __future__ import annotations

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """`authorization: Bearer <token>` for every call (none without a token)."""
    if token is None:
        return ()
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError("token must be non-empty printable text without spaces")
    return (("authorization", f"Bearer {token}"),)


def channel_options(
    address: str, timeout_s: float | None, max_message_bytes: int
) -> list[tuple[str, int]]:
    """gRPC channel options after checking the constructor's arguments."""
    if not address or address != address.strip():
        raise ValueError(f"address must be a non-empty HOST:PORT, got {address!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
    if max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
