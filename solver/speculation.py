"""TPOT with speculative decoding: one trip verifies N drafted tokens (nodes/generation/speculate.py).

A trip with N + 1 positions costs what a plain token's trip costs (every hop, k rounds, every streamed
layer's read: `tpot_s` of cost_model.evaluate) plus the compute of N more positions (`position_compute_s`):
decode is memory bound, so a position more costs its arithmetic only (FLOPs at the device's rate) on every layer
it passes, and on the head the output projection of one more row. With per-token acceptance rate a, a trip
yields (1 - a^(N+1)) / (1 - a) tokens on average (the accepted prefix plus the target's own token), as in
Leviathan et al. 2023.

With D windows in flight (nodes/ring/inflight.py) the drafted tokens form one chain verified window by window.
A window of N drafts takes `latency` = its drafting plus its trip; windows come back one `period` apart, no
faster than the slowest device computes one (its stage), nor than D a latency. At the first rejection the
target's own token is emitted and the chain starts again; the tokens up to it, K accepted plus that one, are
geometric (E = 1 / (1 - a)), and it came back floor(K / N) periods after the chain's first window
(E = a^N / (1 - a^N)). So a token costs (latency + period a^N / (1 - a^N)) (1 - a); D = 1 is the classic
trip above.
"""

from prima_rpc.spec.speculation import DEPTH, DRAFT_TOKENS
from solver.cost_model import Instance, evaluate


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


def inflight_tpot(tpot_s: float, stage_s: float, position_compute_s: float, draft_s: float, draft: int,
                  depth: int, rate: float) -> float:
    """Expected seconds per output token with `depth` windows of `draft` drafts in flight; stage_s: the
    slowest device's share of a plain trip; draft_s: the drafter's time per drafted token (on the head)."""
    if draft == 0:
        return tpot_s
    latency = tpot_s + draft * (position_compute_s + draft_s)
    if depth == 1:
        return latency / tokens_per_trip(draft, rate)
    period = max(stage_s + draft * (position_compute_s + draft_s), latency / depth)
    if rate == 1.0:
        return period / draft
    return (latency + period * rate ** draft / (1.0 - rate ** draft)) * (1.0 - rate)


def best_inflight(tpot_s: float, stage_s: float, position_compute_s: float, draft_s: float,
                  rate: float) -> tuple[int, int, float]:
    """(depth, draft length, TPOT) with the lowest expected TPOT; (1, 0, the plain TPOT) where speculating does
    not pay. Ties go to fewer windows and fewer drafts."""
    plain = (1, 0, tpot_s)
    choices = ((d, n, inflight_tpot(tpot_s, stage_s, position_compute_s, draft_s, n, d, rate))
               for d in range(DEPTH[0], DEPTH[1] + 1) for n in range(DRAFT_TOKENS[0], DRAFT_TOKENS[1] + 1))
    return min([plain, *choices], key=lambda t: (t[2], t[0], t[1]))


def stage_s(inst: Instance, k: int, w: list[int], n: list[int]) -> float:
    """The slowest device's time a token (its compute and reads): windows in flight come back no faster."""
    b = evaluate(inst, k, w, n)
    return max(c + d for c, d in zip(b.compute_s, b.disk_s))


def inflight_json(inst: Instance, k: int, w: list[int], n: list[int], tpot_s: float, rate: float,
                  draft_s: float = 0.0) -> dict:
    """The plan's choice of windows in flight for drafts accepted at `rate` costing draft_s each: `depth`
    and `inflight_draft_tokens` (1 and 0: plain decoding) and the TPOT predicted with them."""
    pos, stage = position_compute_s(inst, k, w, n), stage_s(inst, k, w, n)
    depth, draft, tpot = best_inflight(tpot_s, stage, pos, draft_s, rate)
    return {"depth": depth, "inflight_draft_tokens": draft, "tpot_ms_inflight": tpot * 1e3,
            "stage_ms": stage * 1e3, "draft_ms": draft_s * 1e3}
