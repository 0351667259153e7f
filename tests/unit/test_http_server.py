"""The HTTP shell on a real uvicorn server on loopback, in front of a real Coordinator whose
workers are scripted (no Ray, no Redis): TLS, mutual TLS, the gate, body limits and SSE framing."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.coordinator.config import HttpConfig
from kvmesh.coordinator.service.auth import Authenticator
from kvmesh.coordinator.service.http_server import HttpGate, HttpServer, build_app
from kvmesh.coordinator.service.limits import StreamSlots
from tests.certificates import CertificateFiles, make_certificates
from tests.unit.test_openai_frontend import frontend

TOKEN = "http-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def serve(tmp: Path | None = None, certs: CertificateFiles | None = None, **kw: str) -> HttpServer:
    fe, _backend = frontend("Hello, world")
    gate = HttpGate(Authenticator([TOKEN], []), streams=StreamSlots(1))
    app = build_app(fe, gate, max_body_bytes=2048)
    tls = {}
    if certs is not None:
        tls = {"tls_cert_file": str(certs.server_cert), "tls_key_file": str(certs.server_key)}
    server = HttpServer(app, HttpConfig(port=0), **tls, **kw)
    server.start()
    return server


@pytest.fixture
def plain() -> Iterator[HttpServer]:
    server = serve()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertificateFiles:
    return make_certificates(tmp_path_factory.mktemp("certs"))


def test_sse_frames_every_chunk_and_ends_with_done(plain: HttpServer) -> None:
    body = {"model": "tiny-random", "prompt": "q", "max_tokens": 50, "stream": True}
    r = httpx.post(plain.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == "Hello, world"


def test_gate_body_limit_and_unknown_routes_answer_in_openai_shape(plain: HttpServer) -> None:
    url = plain.url
    r = httpx.get(url + "/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # open
    big = {"model": "tiny-random", "prompt": "x" * 4096}
    r = httpx.post(url + "/v1/completions", json=big, headers=AUTH, timeout=30)
    assert r.status_code == 413 and "2048 bytes" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/nothing", headers=AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.post(url + "/v1/completions", content=b"\xff\xfe", headers=AUTH, timeout=30)
    assert r.status_code == 400
    ok = {"model": "tiny-random", "prompt": "q", "max_tokens": 2}
    r = httpx.post(url + "/v1/completions", json=ok, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "He"


def test_a_stream_slot_is_returned_when_the_stream_ends(plain: HttpServer) -> None:
    body = {"model": "tiny-random", "prompt": "q", "max_tokens": 3, "stream": True}
    for _ in range(3):  # one slot: a leaked slot would make the second call a 429
        r = httpx.post(plain.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200


def test_with_a_certificate_the_port_speaks_https_only(certs: CertificateFiles) -> None:
    server = serve(certs=certs)
    try:
        assert server.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(certs.ca))
        r = httpx.get(server.url + "/health", verify=context, timeout=30)
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)
    finally:
        server.stop()


def test_with_a_client_ca_a_client_certificate_is_required(certs: CertificateFiles) -> None:
    server = serve(certs=certs, tls_client_ca_file=str(certs.ca))
    try:
        bare = ssl.create_default_context(cafile=str(certs.ca))
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url + "/health", verify=bare, timeout=10)
        mutual = ssl.create_default_context(cafile=str(certs.ca))
        mutual.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        assert httpx.get(server.url + "/health", verify=mutual, timeout=30).status_code == 200
    finally:
        server.stop()
