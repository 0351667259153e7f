"""Moving KV between workers: what travels, link pricing, and the block-copy kernel."""
