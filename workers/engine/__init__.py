"""The engine: pure worker, continuous-batching scheduler, sequences, sampling, messages, events."""
