"""The checked-in stubs are exactly what `make proto` generates from proto/kvmesh.proto."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.proto import generate


def test_regenerated_stubs_equal_the_checked_in_ones(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    for path in generate.generate(tmp_path):
        checked_in = generate.PROTO_DIR / path.name
        assert path.read_bytes() == checked_in.read_bytes(), f"{path.name} is stale: run make proto"


def test_stubs_import_under_the_package_name() -> None:
    from kvmesh.proto import kvmesh_pb2, kvmesh_pb2_grpc

    assert kvmesh_pb2.DESCRIPTOR.package == "kvmesh.v1"
    assert hasattr(kvmesh_pb2_grpc, "KVMeshStub")
