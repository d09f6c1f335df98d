"""Window sizes (layers per device per round) and the half-open layer ranges they make, in prima.cpp's order.

Plain arithmetic with no imports, so the application and the nodes use it without loading the solver."""


def layer_ranges(window_sizes: list[int], n_layers: int) -> list[list[tuple[int, int]]]:
    """Half-open layer ranges per device (ring order, head first) in prima.cpp order: each round
    goes to ranks 1..M-1 and then rank 0, so the head holds the last window of every round."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if any(w < 0 for w in window_sizes):
        raise ValueError(f"window_sizes must be >= 0, got {window_sizes}")
    W = sum(window_sizes)
    if W == 0:
        raise ValueError(f"at least one window must be > 0, got {window_sizes}")
    if n_layers % W:
        raise ValueError(f"sum(window_sizes)={W} does not divide n_layers={n_layers}")
    out: list[list[tuple[int, int]]] = [[] for _ in window_sizes]
    order = list(range(1, len(window_sizes))) + [0]
    start = 0
    for _ in range(n_layers // W):  # rounds
        for m in order:
            if window_sizes[m]:
                out[m].append((start, start + window_sizes[m]))
                start += window_sizes[m]
    return out


def even_windows(n_layers: int, nodes: int) -> list[int]:
    """Window sizes of one round (k = 1) as even as the layer count allows; the head (first) takes the
    remainder."""
    base, extra = divmod(n_layers, nodes)
    return [base + extra] + [base] * (nodes - 1)
