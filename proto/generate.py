"""Regenerate the gRPC stubs: `python -m kvmesh.proto.generate` (or `make proto`).

The .proto is mirrored to its import path (kvmesh/proto/) in a scratch folder so the generated
code imports `kvmesh.proto.kvmesh_pb2`, then the outputs are copied next to the source. The stubs
are checked in and never edited by hand; a test regenerates them and fails on any difference.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
OUTPUTS = ("kvmesh_pb2.py", "kvmesh_pb2.pyi", "kvmesh_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for proto/kvmesh.proto into `out_dir`; returns their paths."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        mirrored = root / "kvmesh" / "proto"
        mirrored.mkdir(parents=True)
        shutil.copy(PROTO_DIR / "kvmesh.proto", mirrored / "kvmesh.proto")
        include = Path(protoc.__file__).resolve().parent / "_proto"
        args = [
            "protoc",
            f"-I{root}",
            f"-I{include}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            "kvmesh/proto/kvmesh.proto",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            shutil.copy(mirrored / name, out_dir / name)
            written.append(out_dir / name)
        return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
