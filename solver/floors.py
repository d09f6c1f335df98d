"""Lower bounds on a plan's cycle (TPOT - kappa) where devices read from disk: Halda prunes with them."""

from __future__ import annotations

import math

from solver.device_costs import DeviceCosts


def offload_floor(c: DeviceCosts, k: int = 1) -> float:
    """Least cycle (TPOT - kappa) of the device in any k-round plan where it reads from disk: its first share
    that does not fit, computed (P_m), or read past its memory with one layer of buffer beside the compute its
    reads cannot overlap (D_m, s_m), and, off the head, its k hops (device_rows' cycle row). Grows with k."""
    if c.forced_fit or c.ram_layers < 0:
        return math.inf
    s = c.ram_layers + 1
    if c.uma:
        return s * (min(c.alpha, c.gpu) + c.b / c.disk)
    hops = 0.0 if c.is_head else k * c.hop  # the head's hop is paid only when it talks
    if c.experts:  # a mixture reads only the expected misses, with no buffer (device_terms.expert_terms)
        return max(s * c.alpha, c.experts * (s * c.b_prime - c.ram) / c.disk + s * c.dense_alpha) + hops
    return max(s * c.alpha, (s * c.b_prime - c.ram + c.b) / c.disk + k * c.serial) + hops


def reads_floor(cs: list[DeviceCosts], k: int, L: int) -> float:
    """Least cycle (TPOT - kappa) of any k-round plan for L layers from its reads alone: what all memories
    (RAM, and VRAM off Metal) cannot hold, O = L b' - sum(memory), is read every token, device m reading
    o_m of it in a cycle of at least (o_m + b)/d_m + k s_m (+ k hops off the head; Metal re-reads its share,
    at least o_m b/b' bytes); the least t with sum_m of what m can read by t >= O (0 when all fits). Grows
    with k."""
    need = L * cs[0].b_prime - sum(max(c.ram, 0) + (0 if c.uma else c.gpu_cap * c.b_prime) for c in cs)
    if need <= 0:
        return 0.0
    if cs[0].experts:  # a mixture reads top-k/E of it (the expected misses), each device with no buffer
        need *= cs[0].experts
        readers = [(c.disk, 0.0 if c.is_head else k * c.hop, 0.0) for c in cs if not c.forced_fit]
    else:
        readers = [(c.disk * c.b_prime / c.b, 0.0, 0.0) if c.uma else
                   (c.disk, k * c.serial + (0.0 if c.is_head else k * c.hop), c.b)
                   for c in cs if not c.forced_fit]  # (B/s, fixed s, buffer bytes)
    if not readers:
        return math.inf

    def readable(t: float) -> float:
        return sum(max(0.0, (t - fixed) * d - buf) for d, fixed, buf in readers)

    lo, hi = 0.0, 1.0
    while readable(hi) < need:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if readable(mid) < need else (lo, mid)
    return lo

