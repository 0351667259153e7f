"""A worker: one GPU's KV and model (engine, model, kv, transfer; actor.py is the Ray shell)."""
