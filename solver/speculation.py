"""TPOT with speculative decoding: one trip verifies N drafted tokens (nodes/speculate.py).

A trip with N + 1 positions costs what a plain token's trip costs (every hop, k rounds, every streamed
layer's read: `tpot_s` of cost_model.evaluate) plus the compute of N more positions on every layer
(`position_compute_s`: a plain token's summed compute, an upper bound since decode matmuls are memory bound).
With per-token acceptance rate a, a trip yields (1 - a^(N+1)) / (1 - a) tokens on average (the accepted
prefix plus the target's own token), as in Leviathan et al. 2023.
"""


def tokens_per_trip(draft: int, rate: float) -> float:
    if not 0.0 <= rate <= 1.0 or draft < 0:
        raise ValueError(f"need draft >= 0 and rate in [0, 1], got {draft}, {rate}")
    return draft + 1.0 if rate == 1.0 else (1.0 - rate ** (draft + 1)) / (1.0 - rate)


def speculative_tpot(tpot_s: float, position_compute_s: float, draft: int, rate: float) -> float:
    """Expected seconds per output token when every trip verifies `draft` tokens."""
    return (tpot_s + draft * position_compute_s) / tokens_per_trip(draft, rate)


def best_draft(tpot_s: float, position_compute_s: float, rate: float, most: int = 16) -> tuple[int, float]:
    """The draft length (0: do not speculate) with the lowest expected TPOT, and that TPOT."""
    return min(((n, speculative_tpot(tpot_s, position_compute_s, n, rate)) for n in range(most + 1)),
               key=lambda t: (t[1], t[0]))
