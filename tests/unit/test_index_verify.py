"""`kvmesh index verify` (comparison, flags) and the server-side security flags of the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmesh.client import cli
from kvmesh.client.environment import read_environment
from kvmesh.client.index_verify import compare, render
from kvmesh.client.parser import build_parser
from kvmesh.client.results import IndexReport, WorkerIndexView
from kvmesh.coordinator.cluster.launcher import deployment_config


def view(worker: str, mirror: set[int], pool: set[int], *, owned: bool = True) -> WorkerIndexView:
    return WorkerIndexView(worker, True, sorted(mirror), sorted(pool), 1, 1, owned)


def test_identical_views_are_consistent() -> None:
    report = compare({"a:1": IndexReport([view("w0", {1, 2}, {1, 2})], True)}, {"w0": {1, 2}})
    assert report.consistent and report.notes == []
    assert report.counts == {"w0": {"pool": 2, "mirror@a:1": 2, "redis": 2}}


def test_each_view_is_held_to_the_pool_and_differences_name_the_hashes() -> None:
    reports = {"a:1": IndexReport([view("w0", {1, 2, 9}, {1, 2, 3})], True)}
    report = compare(reports, {"w0": {1, 2}})
    by_source = {d.source: d for d in report.differences}
    assert by_source["redis"].missing == [f"{3:016x}"] and by_source["redis"].num_extra == 0
    assert by_source["mirror@a:1"].num_missing == 1 and by_source["mirror@a:1"].num_extra == 1
    assert all(d.reference == "pool" for d in report.differences)
    text = render(report, 3, redis_compared=True)
    assert "DIFFERENCE w0: redis lacks 1 block(s)" in text and "2 difference(s)" in text


def test_a_worker_no_queried_coordinator_runs_is_held_to_redis() -> None:
    reports = {
        "a:1": IndexReport([view("w0", {1}, {1}), view("w7", {5}, set(), owned=False)], True),
        "b:2": IndexReport([view("w0", {1}, set(), owned=False), view("w7", {5, 6}, {5, 6})], True),
    }
    report = compare(reports, {"w0": {1}, "w7": {5, 6}})
    assert [(d.worker_id, d.source, d.reference) for d in report.differences] == [
        ("w7", "mirror@a:1", "pool")
    ]
    # b lost Redis and its workers: its mirror is frozen, and w7 is run by no queried coordinator.
    frozen = [view("w0", {1}, set(), owned=False), view("w7", {5, 6}, set(), owned=False)]
    reports["b:2"] = IndexReport(frozen, False)
    report = compare(reports, {"w0": {1}, "w7": {5, 6}})
    assert [(d.source, d.reference) for d in report.differences] == [("mirror@a:1", "redis")]
    assert "b:2 cannot reach Redis" in report.notes[0]


def test_a_dead_worker_must_be_gone_from_every_view() -> None:
    dead = WorkerIndexView("w1", False, [4], [], 1, 1, True)
    report = compare({"a:1": IndexReport([dead], True)}, {"w1": {4}})
    assert {d.source for d in report.differences} == {"redis", "mirror@a:1"}


def test_index_verify_flags_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    env = read_environment({"KVMESH_REDIS_URL": "redis://:pw-hidden@h:1/0"})
    args = build_parser(env).parse_args(["index", "verify", "--address", "a:1", "b:2"])
    assert args.address == ["a:1", "b:2"] and args.wait == 5.0
    assert args.redis_url == "redis://:pw-hidden@h:1/0"
    assert cli.main(["index", "verify", "--help"]) == 0
    assert "kvmesh index verify" in capsys.readouterr().out


def test_help_never_shows_a_token_or_password_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in [
        ("KVMESH_TOKEN", "tok-hidden"),
        ("KVMESH_AUTH_TOKEN", "auth-hidden"),
        ("KVMESH_ADMIN_TOKEN", "admin-hidden"),
        ("KVMESH_REDIS_URL", "redis://:pw-hidden@h:1/0"),
    ]:
        monkeypatch.setenv(name, value)
    for command in (["up"], ["serve"], ["stats"], ["index", "verify"]):
        assert cli.main([*command, "--help"]) == 0
        assert "hidden" not in capsys.readouterr().out


def test_security_flags_reach_the_coordinator_config(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("file-token-1\nfile-token-2\n")
    args = build_parser(read_environment({"KVMESH_ADMIN_TOKEN": "adm"})).parse_args(
        [
            "up", "--auth-token", "flag-token", "--auth-token-file", str(tokens),
            "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
            "--max-prompt-tokens", "512", "--max-concurrent-streams", "8",
            "--rate-limit", "2.5", "--rate-limit-burst", "5",
        ]
    )  # fmt: skip
    cc = deployment_config(args, embedded_redis=True).coordinator
    assert cc.auth_tokens == ("flag-token", "file-token-1", "file-token-2")
    assert cc.admin_tokens == ("adm",)
    assert (cc.tls_cert_file, cc.tls_key_file, cc.tls_client_ca_file) == (
        "c.pem",
        "k.pem",
        "ca.pem",
    )
    assert (cc.max_prompt_tokens, cc.max_concurrent_streams) == (512, 8)
    assert (cc.rate_limit_rps, cc.rate_limit_burst) == (2.5, 5)


@pytest.mark.parametrize(
    "argv", [["up", "--rate-limit", "-1"], ["serve", "--redis-url", "r", "--rate-limit", "inf"]]
)
def test_limit_flags_are_range_checked(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser(read_environment({})).parse_args(argv)
    assert "must be a finite number >= 0" in capsys.readouterr().err


def test_client_flags_build_a_tls_client_with_a_token(tmp_path: Path) -> None:
    from kvmesh.client.commands import client_from_args

    args = argparse.Namespace(
        timeout=None, token="t", tls=True, tls_ca=None, tls_cert=None, tls_key=None
    )
    with client_from_args(args, "127.0.0.1:1") as client:
        assert client.address == "127.0.0.1:1"
    args.tls_ca = str(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="cannot read the TLS CA file"):
        client_from_args(args, "127.0.0.1:1")
