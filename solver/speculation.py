"""TPOT with speculative decoding: one trip verifies N drafted tokens (nodes/generation/speculate.py).

A trip with N + 1 positions costs what a plain token's trip costs (every hop, k rounds, every streamed
layer's read: `tpot_s` of cost_model.evaluate) plus the compute of N more positions (`position_compute_s`):
decode is memory bound, so a position more costs its arithmetic only (FLOPs at the device's rate) on every layer
it passes, and on the head the output projection of one more row. With per-token acceptance rate a, a trip
yields (1 - a^(N+1)) / (1 - a) tokens on average (the accepted prefix plus the target's own token), as in
Leviathan et al. 2023.
"""

from solver.cost_model import Instance


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


def position_compute_s(inst: Instance, k: int, w: list[int], n: list[int]) -> float:
    """Seconds one more position of a verification frame adds to a trip: w_m layers a round (n_m of them on the
    GPU), k rounds, at each device's FLOP rate, and the head's output projection of one more row."""
    m = inst.model
    layers = sum(k * m.layer_flops * ((wm - nm) / d.cpu_flops + (nm / d.gpu_flops if nm else 0.0))
                 for d, wm, nm in zip(inst.devices, w, n))
    return layers + m.output_flops / inst.devices[0].cpu_flops


def speculation_json(inst: Instance, k: int, w: list[int], n: list[int], tpot_s: float, draft: int,
                     rate: float) -> dict:
    """`prima-ctl plan --speculate-accept R --draft-tokens N`: the plan's TPOT when every trip verifies N drafts
    accepted at rate R, and the draft length that would be best (0: speculating does not pay)."""
    pos = position_compute_s(inst, k, w, n)
    best, best_tpot = best_draft(tpot_s, pos, rate)
    return {"accept_rate": rate, "draft_tokens": draft, "tokens_per_trip": tokens_per_trip(draft, rate),
            "position_compute_ms": pos * 1e3, "trip_ms": (tpot_s + draft * pos) * 1e3,
            "tpot_ms_speculative": speculative_tpot(tpot_s, pos, draft, rate) * 1e3,
            "best_draft_tokens": best, "tpot_ms_best": best_tpot * 1e3}
