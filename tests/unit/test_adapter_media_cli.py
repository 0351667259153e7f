"""The CLI's adapter and media flags: parsed into worker configs and client calls."""

from __future__ import annotations

import pytest

from kvmesh.client.commands import _prompt_kwargs
from kvmesh.client.environment import read_environment
from kvmesh.client.parser import build_parser
from kvmesh.coordinator.cluster.launcher import deployment_config
from kvmesh.proto.block_hash import MediaItem
from kvmesh.workers.config import WorkerConfig


def test_lora_flags_reach_every_workers_config() -> None:
    parser = build_parser(read_environment({}))
    args = parser.parse_args(["up", "--lora", "sql=/a/sql", "--lora", "chat=/b"])
    worker = deployment_config(args, embedded_redis=True).worker
    assert worker.lora_adapters == (("sql", "/a/sql"), ("chat", "/b"))


def test_media_and_adapter_flags_reach_the_client_call() -> None:
    parser = build_parser(read_environment({}))
    args = parser.parse_args(
        ["lookup", "--tokens", "1,2,3", "--adapter", "sql", "--media", "0xca7:1:2"]
    )
    assert _prompt_kwargs(args) == {
        "token_ids": [1, 2, 3],
        "adapter": "sql",
        "media": (MediaItem(0xCA7, 1, 2),),
    }


@pytest.mark.parametrize(
    "argv",
    [["up", "--lora", "sql"], ["up", "--lora", "=x"], ["route", "--tokens", "1", "--media", "1:2"]],
)
def test_malformed_flags_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser(read_environment({}))
    with pytest.raises(SystemExit) as raised:
        parser.parse_args(argv)
    assert raised.value.code == 2
    assert "expected" in capsys.readouterr().err


def test_duplicate_adapter_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unique and non-empty, got \['a', 'a'\]"):
        WorkerConfig(worker_id="w0", lora_adapters=(("a", "/x"), ("a", "/y")))
    restored = WorkerConfig(worker_id="w0", lora_adapters=[["a", "/x"]])  # type: ignore[arg-type]
    assert restored.lora_adapters == (("a", "/x"),)
