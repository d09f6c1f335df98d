"""Generation: the per-request state machine, sampling, speculation, text, and the single-process reference."""
