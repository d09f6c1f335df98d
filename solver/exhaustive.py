"""Exhaustive search over every (k, w, n) of the cost model: the test oracle for Halda on small instances."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from solver.cost_model import Instance, device_costs, disk_time, fits, inline_disk_time, kappa, window_ok
from solver.halda import divisors


@dataclass(frozen=True)
class Optimum:
    tpot_s: float
    k: int
    w: tuple[int, ...]
    n: tuple[int, ...]
    evaluated: int  # assignments scored


def exhaustive(inst: Instance, select: bool = True) -> Optimum | None:
    """Enumerate all assignments Halda may return (same rows: VRAM, windows fit, slow disks fit).
    select: a device with no layers leaves the ring when it can; else all stay (w >= 1 if able)."""
    cs = device_costs(inst)
    L, kap = inst.model.n_layers, kappa(inst)
    if cs[0].ram < 0:
        return None
    best: Optimum | None = None
    for k in divisors(L):
        W = L // k
        sum_w = np.zeros(1, dtype=np.int64)
        ring = np.zeros(1)  # sum of P + hops + inline loads (the head's hop is added when anyone else stays)
        talks = np.zeros(1, dtype=bool)
        slow = np.full(1, -np.inf)  # max over offloading devices of P + D
        code = np.zeros(1, dtype=np.int64)
        opts_all = []
        for c in cs:
            able = c.ram_layers + c.gpu_cap // k >= 1
            opts = []
            for w in range(W + 1):
                if not select and able and w == 0:
                    continue
                for n in range(min(w, c.gpu_cap // k) + 1):
                    if not window_ok(c, w, n) or (c.forced_fit and not fits(c, k, w, n)):
                        continue
                    P = k * (c.alpha * (w - n) + (c.gpu * n if n else 0.0))
                    stays = w > 0 or not c.routable or not select
                    D = disk_time(c, k, w, n)
                    hop = k * c.hop if stays and not c.is_head else 0.0
                    ring_part = P + hop + inline_disk_time(c, k, w, n)
                    opts.append((w, n, ring_part, P + D if D > 0 else -np.inf, stays and not c.is_head))
            if not opts:
                sum_w = sum_w[:0]
                break
            opts_all.append(opts)
            ow = np.array([o[0] for o in opts])
            s = sum_w[:, None] + ow[None, :]
            keep = s <= W
            sum_w = s[keep]
            ring = (ring[:, None] + np.array([o[2] for o in opts])[None, :])[keep]
            slow = np.maximum(slow[:, None], np.array([o[3] for o in opts])[None, :])[keep]
            talks = (talks[:, None] | np.array([o[4] for o in opts])[None, :])[keep]
            code = (code[:, None] * len(opts) + np.arange(len(opts))[None, :])[keep]
        done = sum_w == W
        if not done.any():
            continue
        tpot = kap + np.maximum(ring[done] + k * cs[0].hop * talks[done], slow[done])
        i = int(np.argmin(tpot))
        if best is None or tpot[i] < best.tpot_s - 1e-12:
            c_i, ws, ns = int(code[done][i]), [], []
            for opts in reversed(opts_all):
                c_i, j = divmod(c_i, len(opts))
                ws.append(opts[j][0])
                ns.append(opts[j][1])
            best = Optimum(float(tpot[i]), k, tuple(reversed(ws)), tuple(reversed(ns)),
                           int(done.sum()) + (best.evaluated if best else 0))
        elif best is not None:
            best = Optimum(best.tpot_s, best.k, best.w, best.n, best.evaluated + int(done.sum()))
    return best if best is not None and math.isfinite(best.tpot_s) else None
