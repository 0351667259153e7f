"""Routing: the policy interface, kvmesh's cost router, baselines, load and pull planning."""
