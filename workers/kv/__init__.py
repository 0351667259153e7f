"""KV memory: the paged device block pool and the pinned host-memory tier."""
