"""Baseline placements to compare Halda with: even split, exo's memory-proportional split, Halda without selection."""

from __future__ import annotations

import time

from solver.cost_model import Instance, device_costs
from solver.halda import halda
from solver.plan import Infeasible, RingPlan, build_plan


def _round_shares(weights: list[float], total: int) -> list[int]:
    """Largest-remainder rounding of total * weights / sum(weights) (ties to the earlier device)."""
    s = sum(weights)
    if s <= 0:
        weights, s = [1.0] * len(weights), float(len(weights))
    raw = [total * x / s for x in weights]
    out = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def _one_round(inst: Instance, w: list[int], strategy: str, t0: float) -> RingPlan:
    # k = 1, every device kept; each puts as many of its layers on its GPU as VRAM allows.
    n = [min(wm, c.gpu_cap) for c, wm in zip(device_costs(inst), w)]
    ms = (time.perf_counter() - t0) * 1e3
    return build_plan(inst, 1, w, n, [True] * len(w), ms, strategy)


def even_split(inst: Instance) -> RingPlan:
    t0 = time.perf_counter()
    return _one_round(inst, _round_shares([1.0] * len(inst.devices), inst.model.n_layers), "even", t0)


def exo_split(inst: Instance) -> RingPlan:
    """exo: layers proportional to each device's memory (RAM + VRAM available), one round."""
    t0 = time.perf_counter()
    mem = [d.ram_available + (0 if d.unified_memory else d.vram_free) for d in inst.devices]
    return _one_round(inst, _round_shares([float(m) for m in mem], inst.model.n_layers), "exo", t0)


def halda_noselect(inst: Instance) -> RingPlan | Infeasible:
    """prima.cpp's Halda before device selection: every device stays and computes >= 1 layer."""
    return halda(inst, select=False)
