"""kvmesh.coordinator."""
