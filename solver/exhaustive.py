"""Exhaustive search over every (k, w, n) of the cost model: the test oracle for Halda on small instances.

Independent of the ILP: for a candidate TPOT T, each device option (w, n) has a least turn time
(device_terms.device_terms, and stream_turn hiding in its gaps what their length allows) or is impossible; a dynamic
program over devices then finds the least ring round over all assignments with sum w = W. T is
feasible when that round fits in T, which only gets easier as T grows, so bisection on T gives the
exact optimum, and the DP's choices at it the assignment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from solver.cost_model import Instance, device_costs, kappa
from solver.device_terms import allowed, device_terms, stream_turn
from solver.halda import divisors

INF = math.inf


@dataclass(frozen=True)
class Optimum:
    tpot_s: float
    k: int
    w: tuple[int, ...]
    n: tuple[int, ...]
    evaluated: int  # assignments of (w, n) per device the DP ranged over


@dataclass(frozen=True)
class _Options:
    """One device's (w, n) options for a fixed k, as arrays."""
    w: np.ndarray
    n: np.ndarray
    P: np.ndarray  # compute per token
    ovf: np.ndarray  # overflow bytes (streaming options), else nan
    fixed_turn: np.ndarray  # turn of non-streaming options (nan for streaming ones)
    metal_row: np.ndarray  # P + D a Metal option's re-reads need below T - kappa (0 otherwise)


def _options(c, k: int, W: int, select: bool) -> _Options | None:
    able = c.ram_layers + c.gpu_cap // k >= 1
    rows = []
    for w in range(W + 1):
        if not select and able and w == 0:
            continue
        for n in range(min(w, c.gpu_cap // k) + 1):
            if not allowed(c, k, w, n):
                continue
            t = device_terms(c, k, w, n)
            streaming = t.overflow is not None
            rows.append((w, n, t.compute, t.overflow if streaming else np.nan, np.nan if streaming else t.turn,
                         t.cycle))
    if not rows:
        return None
    a = np.array(rows, dtype=float)
    return _Options(a[:, 0].astype(int), a[:, 1].astype(int), a[:, 2], a[:, 3], a[:, 4], a[:, 5])


def _turns(c, k: int, opt: _Options, Tk: float, hop: float) -> np.ndarray:
    """Least turn per option at TPOT - kappa = Tk with its own hops `hop`; inf where impossible."""
    stream = ~np.isnan(opt.ovf)
    z = np.where(stream | (opt.metal_row > Tk), np.inf, opt.fixed_turn)  # a Metal share's re-reads outlast T
    if stream.any():
        z[stream] = stream_turn(c.disk, c.b, k * c.serial, k, opt.P[stream], opt.ovf[stream], Tk - hop,
                                c.alpha, c.copy, c.shared_host, c.cold)[0]
    return z


def _round(opts, cs, k: int, W: int, T: float, kap: float, select: bool, choose: bool = False):
    """Least kappa + turns + hops over assignments with sum w = W at TPOT T (and, with choose, the
    options taken)."""
    head, rest = opts[0], opts[1:]
    # dp[talks][s]: least turns + hops of the non-head devices with s layers in all; talks: one stays.
    dp = np.full((2, W + 1), INF)
    dp[0, 0] = 0.0
    picks = []
    for c, opt in zip(cs[1:], rest):
        stays = (opt.w > 0) | (not c.routable) | (not select)
        hop = k * c.hop
        z = _turns(c, k, opt, T - kap, hop)  # a device that stays talks, so it pays its hop
        z_off = _turns(c, k, opt, T - kap, 0.0)
        cost = np.where(stays, z + hop, z_off)
        new = np.full((2, W + 1), INF)
        arg = np.full((2, W + 1, 2), -1, dtype=np.int64)  # (option, previous talks)
        for i in np.flatnonzero(np.isfinite(cost)):
            wv, s_in = int(opt.w[i]), bool(stays[i])
            for t in (0, 1):
                cand = dp[t, :W + 1 - wv] + cost[i]
                t2 = 1 if (t or s_in) else 0
                better = cand < new[t2, wv:]
                if better.any():
                    new[t2, wv:][better] = cand[better]
                    idx = np.flatnonzero(better) + wv
                    arg[t2, idx, 0], arg[t2, idx, 1] = i, t
        dp = new
        picks.append(arg)
    best, best_at = INF, None
    hc = cs[0]
    for talks in (0, 1):
        hop = k * hc.hop if talks else 0.0
        z = _turns(hc, k, head, T - kap, hop)
        for i in np.flatnonzero(np.isfinite(z)):
            rest_w = W - int(head.w[i])
            if rest_w < 0 or not math.isfinite(dp[talks, rest_w]):
                continue
            total = kap + z[i] + hop + dp[talks, rest_w]
            if total < best:
                best, best_at = total, (i, talks, rest_w)
    if not choose or best_at is None:
        return best, None
    i, talks, s = best_at
    ws, ns = [int(head.w[i])], [int(head.n[i])]
    chosen = []
    for opt, arg in zip(reversed(rest), reversed(picks)):
        j, prev = arg[talks, s]
        chosen.append((int(opt.w[j]), int(opt.n[j])))
        s, talks = s - int(opt.w[j]), int(prev)
    for wv, nv in reversed(chosen):
        ws.append(wv)
        ns.append(nv)
    return best, (tuple(ws), tuple(ns))


def exhaustive(inst: Instance, select: bool = True) -> Optimum | None:
    """The least TPOT over all assignments Halda may return (same rows: VRAM, windows fit, slow disks fit).
    select: a device with no layers leaves the ring when it can; else all stay (w >= 1 if able)."""
    cs = device_costs(inst)
    L, kap = inst.model.n_layers, kappa(inst)
    if cs[0].ram < 0:
        return None
    best: Optimum | None = None
    evaluated = 0
    for k in divisors(L):
        W = L // k
        opts = [_options(c, k, W, select) for c in cs]
        if any(o is None for o in opts):
            continue
        evaluated += math.prod(len(o.w) for o in opts)
        hi = 1e4
        if not _round(opts, cs, k, W, hi, kap, select)[0] <= hi:
            continue
        lo = kap
        while hi - lo > 1e-13 * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if _round(opts, cs, k, W, mid, kap, select)[0] <= mid else (mid, hi)
        if best is None or hi < best.tpot_s * (1 - 1e-12):
            _, (w, n) = _round(opts, cs, k, W, hi, kap, select, choose=True)
            best = Optimum(hi, k, w, n, 0)
    if best is None:
        return None
    return Optimum(best.tpot_s, best.k, best.w, best.n, evaluated)
