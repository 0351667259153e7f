"""A deployment with everything on: mutual TLS (certificates made by the test), bearer tokens, an
admin token and limits. Against it: tenant isolation, property-based fuzzing of the gRPC API
(random fields, extreme values, raw and mutated bytes), the admin RPCs, `kvmesh index verify`,
and no secret in any log line."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import ray
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.client import Client, tls_credentials
from kvmesh.client import cli as kvmesh_cli
from kvmesh.client.errors import PermissionDenied, Unauthenticated
from kvmesh.coordinator.cluster.deployment import Deployment
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.proto import redis_schema as schema
from tests.certificates import CertificateFiles, make_certificates
from tests.integration.fault_helpers import index_matches_pools
from tests.integration.helpers import start_deployment, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray]

USER, ADMIN = "user-tok-5d1f0c", "admin-tok-e88b2a"
VOCAB = 320  # tiny-random
MAX_PROMPT_TOKENS = 1024
PREFIX = [(i * 13) % 250 + 3 for i in range(64)]  # 4 full blocks


class LogRecorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@dataclass
class Secured:
    deployment: Deployment
    certs: CertificateFiles
    credentials: grpc.ChannelCredentials
    logs: LogRecorder

    def client(self, token: str | None = USER) -> Client:
        return Client(
            self.deployment.address, timeout_s=60, credentials=self.credentials, token=token
        )

    @property
    def redis_url(self) -> str:
        assert self.deployment.redis is not None
        return self.deployment.redis.url


@pytest.fixture(scope="module")
def secured(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    certs = make_certificates(tmp_path_factory.mktemp("certs"))
    logs, root = LogRecorder(), logging.getLogger()
    previous_level = root.level
    root.addHandler(logs)
    root.setLevel(logging.DEBUG)
    d = start_deployment(
        num_workers=2,
        num_blocks=128,
        auth_tokens=(USER,),
        admin_tokens=(ADMIN,),
        tls_cert_file=str(certs.server_cert),
        tls_key_file=str(certs.server_key),
        tls_client_ca_file=str(certs.ca),
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_concurrent_streams=16,
    )
    creds = tls_credentials(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    try:
        yield Secured(d, certs, creds, logs)
    finally:
        d.stop()
        root.removeHandler(logs)
        root.setLevel(previous_level)


def generate(client: Client, tokens: list[int], **kw: object) -> object:
    return client.generate(tokens, max_tokens=2, ignore_eos=True, **kw)  # type: ignore[arg-type]


# ---- tenants ------------------------------------------------------------------------------------


def test_a_tenant_never_hits_another_tenants_cache(secured: Secured) -> None:
    client = secured.client()
    prompt = PREFIX + [7, 7, 7]
    first = client.generate(prompt, max_tokens=2, cache_salt="tenant-a")
    holder = first.worker_id
    wait_for(lambda: client.lookup(prompt, cache_salt="tenant-a").matches, what="tenant a indexed")
    again = client.generate(prompt, max_tokens=2, cache_salt="tenant-a", worker_id=holder)
    assert again.cached_tokens == 64  # the same tenant reuses its blocks

    # Tenant b, same prompt: the index shows it nothing, the router sees no match anywhere, and
    # even forced onto the worker that holds tenant a's blocks it computes the whole prompt:
    # exactly the work of a prompt nobody has seen, so its latency cannot tell a hit either.
    assert not client.lookup(prompt, cache_salt="tenant-b").matches
    route = client.route(prompt, cache_salt="tenant-b")
    assert route.matched_tokens == 0 and all(s.matched_blocks == 0 for s in route.scores)
    other = client.generate(prompt, max_tokens=2, cache_salt="tenant-b", worker_id=holder)
    cold = client.generate(
        [(t + 1) % VOCAB for t in prompt], max_tokens=2, cache_salt="tenant-c", worker_id=holder
    )
    assert other.cached_tokens == 0 and other.pulled_tokens == 0
    assert other.computed_tokens == cold.computed_tokens == len(prompt)
    no_salt = client.generate(prompt, max_tokens=2, worker_id=holder)
    assert no_salt.cached_tokens == 0  # "no tenant" is a namespace of its own too
    # ... and tenant b now hits its own blocks.
    wait_for(lambda: client.lookup(prompt, cache_salt="tenant-b").matches, what="b indexed")
    own = client.generate(prompt, max_tokens=2, cache_salt="tenant-b", worker_id=holder)
    assert own.cached_tokens == 64


# ---- fuzzing ------------------------------------------------------------------------------------

_u32 = st.integers(0, 2**32 - 1)
_floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
_texts = st.text(max_size=40)
_token_lists = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), max_size=80),
    st.lists(_u32, max_size=40),
    st.lists(st.integers(0, VOCAB - 1), min_size=MAX_PROMPT_TOKENS - 4, max_size=1100),
)
_sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.sampled_from([0, 1, 2, 3, 2048, 2**31, 2**32 - 1]),
    temperature=st.one_of(st.just(0.0), _floats),
    top_p=_floats,
    top_k=_u32,
    seed=st.integers(0, 2**64 - 1),
    stop_token_ids=st.lists(_u32, max_size=4),
    ignore_eos=st.booleans(),
)
_generate_requests = st.builds(
    pb.GenerateRequest,
    token_ids=_token_lists,
    prompt=st.one_of(st.just(""), _texts),
    sampling=st.one_of(st.none(), _sampling),
    session_id=_texts,
    cache_salt=_texts,
    worker_id=st.sampled_from(["", "", "w0", "w1", "w9", "w0\x00"]),
    request_id=_texts,
)
_route_requests = st.builds(
    pb.RouteRequest,
    token_ids=_token_lists,
    prompt=st.one_of(st.just(""), _texts),
    session_id=_texts,
    cache_salt=_texts,
)
_lookup_requests = st.builds(
    pb.LookupRequest,
    token_ids=_token_lists,
    prompt=st.one_of(st.just(""), _texts),
    cache_salt=_texts,
)
# The statuses a well-behaved server may answer bad input with: never INTERNAL or UNKNOWN.
_CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
_FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI stays reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _mutated(message: bytes, edits: list[tuple[int, int]]) -> bytes:
    data = bytearray(message or b"\x00")
    for position, value in edits:
        data[position % len(data)] = value
    return bytes(data)


_edits = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4)


def _assert_clear(err: grpc.RpcError) -> None:
    assert err.code() in _CLEAR, (err.code(), err.details())
    assert err.details() and "Traceback" not in err.details()


def test_fuzzed_messages_get_clear_statuses_and_corrupt_nothing(secured: Secured) -> None:
    channel = grpc.secure_channel(secured.deployment.address, secured.credentials)
    stub = pb_grpc.KVMeshStub(channel)
    auth = (("authorization", f"Bearer {USER}"),)
    calls = {
        "Generate": lambda r: list(stub.Generate(r, timeout=60, metadata=auth)),
        "Route": lambda r: stub.Route(r, timeout=60, metadata=auth),
        "Lookup": lambda r: stub.Lookup(r, timeout=60, metadata=auth),
    }
    raw = {
        "Generate": channel.unary_stream("/kvmesh.v1.KVMesh/Generate"),
        "Route": channel.unary_unary("/kvmesh.v1.KVMesh/Route"),
        "Lookup": channel.unary_unary("/kvmesh.v1.KVMesh/Lookup"),
        "Stats": channel.unary_unary("/kvmesh.v1.KVMesh/Stats"),
    }
    outcomes: dict[str, int] = {"ok": 0, "refused": 0}

    def send(method: str, request: object) -> None:
        try:
            calls[method](request)
            outcomes["ok"] += 1
        except grpc.RpcError as err:
            _assert_clear(err)
            outcomes["refused"] += 1

    def send_raw(method: str, payload: bytes) -> None:
        call = raw[method]
        try:
            result = call(payload, timeout=60, metadata=auth)
            if method == "Generate":
                list(result)  # type: ignore[call-overload]
            outcomes["ok"] += 1
        except grpc.RpcError as err:
            _assert_clear(err)
            outcomes["refused"] += 1

    @_FUZZ
    @given(request=_generate_requests)
    def fuzz_generate(request: pb.GenerateRequest) -> None:
        send("Generate", request)

    @_FUZZ
    @given(method=st.sampled_from(["Route", "Lookup"]), data=st.data())
    def fuzz_route_lookup(method: str, data: st.DataObject) -> None:
        send(method, data.draw(_route_requests if method == "Route" else _lookup_requests))

    @_FUZZ
    @given(
        method=st.sampled_from(sorted(raw)),
        payload=st.one_of(
            st.binary(max_size=256),
            st.tuples(_generate_requests, _edits).map(
                lambda m: _mutated(m[0].SerializeToString(), m[1])
            ),
        ),
    )
    def fuzz_bytes(method: str, payload: bytes) -> None:
        send_raw(method, payload)

    try:
        fuzz_generate()
        fuzz_route_lookup()
        fuzz_bytes()
    finally:
        channel.close()
    assert outcomes["ok"] > 10 and outcomes["refused"] > 10, outcomes
    # The service still serves, and nothing the fuzzer sent corrupted the index or a pool.
    client = secured.client()
    assert generate(client, PREFIX + [1]).finish_reason == "length"  # type: ignore[attr-defined]
    wait_for(lambda: index_matches_pools(secured.deployment, secured.redis_url), what="index")
    d = secured.deployment
    assert d.cluster is not None
    for w in d.cluster.live_worker_ids():
        assert ray.get(d.cluster.actor(w).check_invariants.remote())
    assert client.stats().num_live_workers == 2


# ---- admin RPCs and index verify ----------------------------------------------------------------


def test_admin_calls_need_the_admin_token(secured: Secured) -> None:
    with pytest.raises(Unauthenticated):
        secured.client(token=None).stats()
    with pytest.raises(PermissionDenied):
        secured.client().drain("w0")
    with pytest.raises(PermissionDenied):
        secured.client().clear_cache()
    assert secured.client().stats().num_rejected_requests >= 3


def test_drain_takes_a_worker_out_of_routing_and_back(secured: Secured) -> None:
    admin, client = secured.client(ADMIN), secured.client()
    assert admin.drain("w0") == ["w0"]
    try:
        for k in range(6):
            assert client.route([5 + k] * 40).worker_id == "w1"
        assert [w.drained for w in client.list_workers()] == [True, False]
        assert client.stats().num_drained_workers == 1
    finally:
        assert admin.drain("w0", undrain=True) == []
    assert {client.route([9 + k] * 40).worker_id for k in range(12)} >= {"w1"}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = kvmesh_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def verify_args(secured: Secured, *extra: str) -> list[str]:
    c = secured.certs
    return [
        "index", "verify", "--address", secured.deployment.address,
        "--redis-url", secured.redis_url, "--token", ADMIN, "--tls-ca", str(c.ca),
        "--tls-cert", str(c.client_cert), "--tls-key", str(c.client_key), *extra,
    ]  # fmt: skip


def test_index_verify_finds_nothing_then_a_planted_difference(
    secured: Secured, capsys: pytest.CaptureFixture[str]
) -> None:
    client = secured.client()
    for k in range(3):
        generate(client, [(i * (k + 3)) % 250 + 3 for i in range(40)])
    code, out, err = run_cli(capsys, *verify_args(secured, "--json"))
    assert code == 0, out + err
    report = json.loads(out)
    assert report["consistent"] and report["redis_compared"]
    assert set(report["counts"]) == {"w0", "w1"}
    assert all(c["pool"] == c["redis"] for c in report["counts"].values())

    # Plant a block in Redis that no pool holds: verify must name it and exit 1.
    r = redis.Redis.from_url(secured.redis_url)
    r.hset(schema.worker_blocks_key("w1"), "00000000deadbeef", "0")
    try:
        code, out, _ = run_cli(capsys, *verify_args(secured, "--wait", "0.3"))
        assert code == 1
        assert "DIFFERENCE w1: redis" in out and "00000000deadbeef" in out
    finally:
        r.hdel(schema.worker_blocks_key("w1"), "00000000deadbeef")
    assert run_cli(capsys, *verify_args(secured))[0] == 0
    # A user token may not read the index views.
    code, _, err = run_cli(capsys, *verify_args(secured)[:-8], "--token", USER,
                           *verify_args(secured)[-6:])  # fmt: skip
    assert code == 1 and "PERMISSION_DENIED" in err


def test_clear_cache_empties_every_pool_and_the_index_follows(secured: Secured) -> None:
    client, admin = secured.client(), secured.client(ADMIN)
    generate(client, PREFIX + [3])
    freed = admin.clear_cache()
    assert set(freed) == {"w0", "w1"} and sum(freed.values()) > 0
    wait_for(lambda: not client.lookup(PREFIX + [3]).matches, what="the index to drop the prefix")
    wait_for(lambda: index_matches_pools(secured.deployment, secured.redis_url), what="index")


def test_cli_over_tls_needs_the_token(secured: Secured, capsys: pytest.CaptureFixture[str]) -> None:
    c = secured.certs
    tls = ["--tls-ca", str(c.ca), "--tls-cert", str(c.client_cert), "--tls-key", str(c.client_key)]
    address = ["--address", secured.deployment.address]
    code, out, _ = run_cli(capsys, "stats", *address, *tls, "--token", USER, "--json")
    assert code == 0 and json.loads(out)["num_live_workers"] == 2
    code, _, err = run_cli(capsys, "stats", *address, *tls)
    assert code == 1 and "UNAUTHENTICATED" in err
    code, _, err = run_cli(capsys, "stats", *address, "--token", USER)  # plaintext: refused
    assert code == 1


def test_no_secret_reached_any_log_line(secured: Secured, tmp_path: Path) -> None:
    """Runs last in this module: everything above was logged at DEBUG into `secured.logs`."""
    text = "\n".join(secured.logs.lines)
    assert "refused /kvmesh.v1.KVMesh/" in text  # refusals were logged ...
    for secret in (USER, ADMIN, secured.certs.client_key.read_text()):
        assert secret not in text  # ... without a token or a key in them
    config_repr = repr(secured.deployment.config)
    assert USER not in config_repr and ADMIN not in config_repr
