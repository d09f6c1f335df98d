import prima_rpc  # noqa: F401  (OpenMP waiting, set before torch loads)
