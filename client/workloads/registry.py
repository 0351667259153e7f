"""The workload registry: each workload by name, its config built from overrides, its requests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kvmesh.client.workloads.agentic import AgenticConfig, agentic
from kvmesh.client.workloads.chat_beside_batch import ChatBesideBatchConfig, chat_beside_batch
from kvmesh.client.workloads.hot_prefix import HotPrefixConfig, hot_prefix
from kvmesh.client.workloads.multi_turn import MultiTurnConfig, multi_turn
from kvmesh.client.workloads.rag import RagConfig, rag
from kvmesh.client.workloads.request import WorkloadRequest
from kvmesh.client.workloads.shared_prefix import SharedPrefixConfig, shared_prefix


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A named workload: its configuration type and its generator."""

    name: str
    """What `--workload` calls it."""
    config_type: type
    """The frozen config dataclass; `--workload-arg FIELD=VALUE` overrides its fields."""
    generate: Callable[[Any, int], list[WorkloadRequest]]
    """(config, seed) -> requests sorted by arrival."""


WORKLOADS: Mapping[str, WorkloadSpec] = {
    s.name: s
    for s in (
        WorkloadSpec("shared_prefix", SharedPrefixConfig, shared_prefix),
        WorkloadSpec("multi_turn", MultiTurnConfig, multi_turn),
        WorkloadSpec("rag", RagConfig, rag),
        WorkloadSpec("agentic", AgenticConfig, agentic),
        WorkloadSpec("hot_prefix", HotPrefixConfig, hot_prefix),
        WorkloadSpec("chat_beside_batch", ChatBesideBatchConfig, chat_beside_batch),
    )
}


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """`["a=1", "b=2.5"]` -> {"a": "1", "b": "2.5"}."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"workload argument {pair!r} is not FIELD=VALUE")
        out[key.strip()] = value.strip()
    return out


def make_config(name: str, overrides: Mapping[str, str | int | float]) -> Any:
    """The named workload's config with `overrides` applied (values converted to field types)."""
    spec = _spec(name)
    base = spec.config_type()
    types = {f.name: f.type for f in fields(base)}
    values: dict[str, int | float] = {}
    for key, raw in overrides.items():
        if key not in types:
            raise ValueError(f"workload {name} has no field {key!r}; fields: {', '.join(types)}")
        kind = int if types[key] in (int, "int") else float
        try:
            values[key] = kind(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{name}.{key} must be {kind.__name__}, got {raw!r}") from None
    return replace(base, **values)


def generate(
    name: str, seed: int, overrides: Mapping[str, str | int | float] | None = None
) -> list[WorkloadRequest]:
    """Requests of the named workload, sorted by arrival; the same arguments give the same list."""
    return _spec(name).generate(make_config(name, overrides or {}), seed)


def _spec(name: str) -> WorkloadSpec:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None
