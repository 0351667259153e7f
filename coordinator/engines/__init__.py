"""External engines (a vLLM or SGLang fleet) as workers: their KV events, their HTTP API."""
