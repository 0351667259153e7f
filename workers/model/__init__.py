"""The model: Llama-family config, weights, paged runner, attention kernels, tokenizers, loading."""
