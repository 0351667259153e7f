"""Bearer-token policy and admission limits: pure classes, a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.service.auth import (
    Authenticator,
    Verdict,
    bearer_token,
    client_key,
    read_token_file,
)
from kvmesh.coordinator.service.limits import RateLimiter, StreamSlots

STATS = "/kvmesh.v1.KVMesh/Stats"
DRAIN = "/kvmesh.v1.KVMesh/Drain"
HEALTH = "/grpc.health.v1.Health/Check"


def test_without_tokens_every_call_is_allowed() -> None:
    auth = Authenticator([], [])
    assert not auth.enabled
    assert auth.check(DRAIN, None) is Verdict.ALLOWED


def test_auth_token_opens_data_calls_but_not_admin_calls() -> None:
    auth = Authenticator(["user-secret"], ["admin-secret"])
    assert auth.check(STATS, None) is Verdict.UNAUTHENTICATED
    assert auth.check(STATS, "Bearer wrong") is Verdict.UNAUTHENTICATED
    assert auth.check(STATS, "Basic user-secret") is Verdict.UNAUTHENTICATED
    assert auth.check(STATS, "Bearer user-secret") is Verdict.ALLOWED
    assert auth.check(STATS, "bearer  user-secret ") is Verdict.ALLOWED
    assert auth.check(DRAIN, "Bearer user-secret") is Verdict.PERMISSION_DENIED
    assert auth.check(DRAIN, "Bearer admin-secret") is Verdict.ALLOWED
    assert auth.check(STATS, "Bearer admin-secret") is Verdict.ALLOWED
    assert auth.check(HEALTH, None) is Verdict.ALLOWED


def test_only_an_auth_token_refuses_every_admin_call() -> None:
    auth = Authenticator(["user-secret"], [])
    assert auth.check(DRAIN, "Bearer user-secret") is Verdict.PERMISSION_DENIED


def test_no_secret_in_repr_of_authenticator_or_config() -> None:
    auth = Authenticator(["user-secret"], ["admin-secret"])
    config = CoordinatorConfig(
        auth_tokens=("user-secret",),
        admin_tokens=("admin-secret",),
        redis_url="redis://:pw-secret@h:1/0",
    )
    for text in (repr(auth), repr(config)):
        assert "secret" not in text, text


def test_bad_tokens_are_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError, match=r"auth_tokens\[1\]") as err:
        CoordinatorConfig(auth_tokens=("ok", "has space-secret"))
    assert "secret" not in str(err.value)


def test_token_file_holds_one_token_per_line(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# rotated 2026-01\nold-token\n\n  new-token  \n")
    assert read_token_file(str(path)) == ("old-token", "new-token")
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no token"):
        read_token_file(str(path))


def test_bearer_token_and_client_key() -> None:
    assert bearer_token(None) is None and bearer_token("Bearer ") is None
    assert bearer_token("Bearer abc") == "abc"
    assert client_key(None, "ipv4:10.0.0.7:53211", authenticated=False) == "ipv4:10.0.0.7"
    keyed = client_key("Bearer abc", "ipv4:10.0.0.7:1", authenticated=True)
    assert keyed.startswith("token:") and "abc" not in keyed
    assert keyed == client_key("Bearer abc", "ipv4:10.9.9.9:2", authenticated=True)


def test_without_auth_a_made_up_token_does_not_buy_a_fresh_bucket() -> None:
    peer = "ipv4:10.0.0.7:53211"
    keys = {client_key(f"Bearer r{k}", peer, authenticated=False) for k in range(40)}
    assert keys == {"ipv4:10.0.0.7"}
    limiter = RateLimiter(1.0, 5, clock=FakeClock())
    allowed = [
        limiter.allow(client_key(f"Bearer r{k}", peer, authenticated=False)) for k in range(40)
    ]
    assert sum(allowed) == 5


def test_an_ipv6_host_counts_by_its_64() -> None:
    a = client_key(None, "ipv6:[2001:db8:1:2::1]:5000", authenticated=False)
    b = client_key(None, "ipv6:[2001:db8:1:2:ffff::9]:6000", authenticated=False)
    c = client_key(None, "ipv6:[2001:db8:1:3::1]:5000", authenticated=False)
    assert a == b == "ipv6:2001:db8:1:2::/64" and c != a
    assert client_key(None, "ipv6:[::1]:5000", authenticated=False) == "ipv6:::/64"
    assert client_key(None, "unix:/tmp/s", authenticated=False) == "unix:/tmp/s"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_limiter_allows_a_burst_then_the_rate() -> None:
    clock = FakeClock()
    limiter = RateLimiter(2.0, 3, clock=clock)
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b")  # clients are counted apart
    clock.now += 0.5  # one token back at 2/s
    assert limiter.allow("a") and not limiter.allow("a")
    clock.now += 100  # refills to the burst, never beyond
    assert sum(limiter.allow("a") for _ in range(10)) == 3
    limiter.check_invariants()


def test_rate_limiter_eviction_never_resets_another_clients_limit() -> None:
    clock = FakeClock()
    limiter = RateLimiter(1.0, 1, clock=clock, max_clients=2)
    assert limiter.allow("a") and limiter.allow("b")  # both buckets now empty: both limited
    # New clients cannot push a or b out (that would hand them a full bucket): they share the
    # overflow bucket, one burst between them.
    assert limiter.allow("c") and not limiter.allow("d") and not limiter.allow("e")
    assert not limiter.allow("a") and not limiter.allow("b")
    limiter.check_invariants()
    clock.now += 5  # a and b refill: dropping a full bucket changes nothing, so f gets one
    assert limiter.allow("f") and limiter.allow("a")
    assert not limiter.allow("f")
    limiter.check_invariants()


def test_stream_slots_never_exceed_capacity() -> None:
    slots = StreamSlots(2)
    assert slots.try_acquire() and slots.try_acquire() and not slots.try_acquire()
    slots.release()
    assert slots.try_acquire()
    slots.release()
    slots.release()
    assert slots.num_active == 0
    with pytest.raises(ValueError, match="without a matching"):
        slots.release()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rate_limit_rps=-1.0), "rate_limit_rps"),
        (dict(max_prompt_tokens=-1), "max_prompt_tokens"),
        (dict(tls_cert_file="c.pem"), "give both"),
        (dict(tls_client_ca_file="ca.pem"), "tls_client_ca_file"),
    ],
)
def test_config_rejects_inconsistent_limits_and_tls(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CoordinatorConfig(**kwargs)
