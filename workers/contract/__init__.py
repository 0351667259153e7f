"""The coordinator-worker contract: frozen dataclasses free of torch and Ray, one module a way."""
