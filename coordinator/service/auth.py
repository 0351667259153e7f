"""Who may call what: bearer tokens for every RPC, admin tokens for the admin RPCs.

Pure policy, no gRPC: the server's interceptor (`service/interceptor.py`) hands it the method
name and the `authorization` metadata value and turns the verdict into a status code.

    no tokens configured         every call allowed (a local `kvmesh up` on 127.0.0.1)
    auth and/or admin tokens     health checks open; any other call needs `Bearer <token>`
                                 with an auth or admin token (else UNAUTHENTICATED);
                                 admin RPCs need an admin token (else PERMISSION_DENIED)

Tokens are compared in constant time and never logged, echoed in an error or kept in a repr.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from pathlib import Path

# Open without a token, so load balancers and `grpc_health_probe` need no secret.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
ADMIN_METHODS = frozenset(
    {
        "/kvmesh.v1.KVMesh/Drain",
        "/kvmesh.v1.KVMesh/ClearCache",
        "/kvmesh.v1.KVMesh/Scale",
        "/kvmesh.v1.KVMesh/VerifyIndex",
        "/kvmesh.v1.KVMesh/IndexTree",
    }
)
_SCHEME = "bearer "


class Verdict(enum.Enum):
    ALLOWED = "allowed"
    UNAUTHENTICATED = "unauthenticated"  # no token, or not one we know
    PERMISSION_DENIED = "permission_denied"  # a valid token that may not make this call


class Authenticator:
    """Checks a call's bearer token against the configured auth and admin tokens."""

    def __init__(self, auth_tokens: Iterable[str], admin_tokens: Iterable[str]) -> None:
        # Digests, not the tokens: equal-length inputs for compare_digest, and no plain secret
        # left in this object's memory dumps or reprs.
        self._admin = [_digest(t) for t in admin_tokens]
        self._auth = [_digest(t) for t in auth_tokens] + self._admin

    def __repr__(self) -> str:
        return f"Authenticator({len(self._auth) - len(self._admin)} auth, {len(self._admin)} admin)"

    @property
    def enabled(self) -> bool:
        return bool(self._auth)

    def check(self, method: str, authorization: str | None) -> Verdict:
        """The verdict for a call of `method` (e.g. "/kvmesh.v1.KVMesh/Stats") carrying the
        `authorization` metadata value (None when absent)."""
        if not self.enabled or method.startswith(OPEN_METHOD_PREFIXES):
            return Verdict.ALLOWED
        token = bearer_token(authorization)
        if token is None:
            return Verdict.UNAUTHENTICATED
        digest = _digest(token)
        is_admin = _contains(self._admin, digest)
        if not is_admin and not _contains(self._auth, digest):
            return Verdict.UNAUTHENTICATED
        if method in ADMIN_METHODS and not is_admin:
            return Verdict.PERMISSION_DENIED
        return Verdict.ALLOWED


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `authorization: Bearer <token>` value (scheme case-insensitive)."""
    if authorization is None or not authorization[: len(_SCHEME)].lower() == _SCHEME:
        return None
    token = authorization[len(_SCHEME) :].strip()
    return token or None


def client_key(authorization: str | None, peer: str, *, authenticated: bool) -> str:
    """Whom a call counts against for rate limiting.

    With auth on (`authenticated`: the token was checked before this is asked), the identity is
    the token (hashed). With auth off a header proves nothing, so any `authorization` is ignored
    and the key is the peer's address without its port ("ipv4:10.0.0.7:53211" ->
    "ipv4:10.0.0.7"); an IPv6 peer counts by its /64, since one host usually owns a whole /64.
    """
    token = bearer_token(authorization) if authenticated else None
    if token is not None:
        return "token:" + _digest(token).hex()[:16]
    return _peer_host(peer)


def _peer_host(peer: str) -> str:
    host, sep, _port = peer.rpartition(":")
    if not sep or not host or not peer.startswith(("ipv4:", "ipv6:")):
        return peer  # e.g. "unix:/run/kvmesh.sock": no port to strip
    if host.startswith("ipv6:[") and host.endswith("]"):
        try:
            net = ipaddress.IPv6Network(f"{host[6:-1]}/64", strict=False)
        except ValueError:
            return host
        return f"ipv6:{net}"
    return host


def read_token_file(path: str) -> tuple[str, ...]:
    """The tokens in a file, one per line (several allow rotation without a restart window);
    blank lines and `#` comments are skipped. Raises ValueError if there is none."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    tokens = tuple(s for s in (line.strip() for line in lines) if s and not s.startswith("#"))
    if not tokens:
        raise ValueError(f"token file {path} holds no token")
    return tokens


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def _contains(digests: list[bytes], digest: bytes) -> bool:
    found = False
    for d in digests:  # no early exit: the time taken does not depend on which token matched
        found |= hmac.compare_digest(d, digest)
    return found
