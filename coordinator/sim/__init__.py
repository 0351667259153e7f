"""The simulator: the real router, mirror and pools driven by a compute cost model."""
