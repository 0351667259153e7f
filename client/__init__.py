"""kvmesh.client."""
