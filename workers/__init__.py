"""kvmesh.workers."""
