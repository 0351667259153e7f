"""kvmesh.proto."""
