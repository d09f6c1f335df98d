"""Halda for a target concurrency (issue 16): the windows that make M requests go fastest together.

For one request the best plan minimises the round trip (halda.py). For M requests the objective is the
period of the batches in flight (solver/throughput.py): with one batch of M it is that batch's round trip
(Halda on the instance at batch M, exact), with G > 1 batches in flight it is at least each resource's work
for all of them, which favours spreading layers over devices that can work at once (a plan that keeps one fast
device for a single request makes it the bottleneck of eight). Each batching (max_batch, micro_batches) gets
its Halda plan (and, for G > 1, one ILP per k with the period rows of halda.build_model); every candidate is
priced by predict_throughput and the best kept. M = 1 is Halda itself, unchanged."""

from __future__ import annotations

import time
from dataclasses import replace

from solver.cost_model import Instance, device_costs, evaluate
from solver.halda import EPS, _in_ring, build_model, divisors, halda, solve
from solver.plan import Infeasible, RingPlan, build_plan
from solver.throughput import Throughput, candidates, predict_throughput


def halda_for(inst: Instance, concurrency: int, select: bool = True) -> tuple[RingPlan, Throughput] | Infeasible:
    """The plan (priced for one request, as every plan is) whose throughput for `concurrency` requests is best,
    and that throughput with its batching."""
    t0 = time.perf_counter()
    options = candidates(concurrency)
    base = halda(inst, select)
    if isinstance(base, Infeasible) or concurrency == 1:
        return base if isinstance(base, Infeasible) else (base, predict_throughput(base, inst, 1))
    strategy, cs = base.strategy, device_costs(inst)
    best, best_t = base, predict_throughput(base, inst, concurrency)
    for b, g in options:
        batched = replace(inst, batch=b)
        sols = []
        one = halda(batched, select)  # one batch in flight: its round trip is the period, Halda's own objective
        if not isinstance(one, Infeasible):
            sols.append((one.k, one.window_sizes, one.gpu_layers, list(one.in_ring)))
        if g > 1:
            for k in divisors(inst.model.n_layers):
                sol = solve(build_model(batched, k, select, micro_batches=g))
                if sol is not None:
                    w, n, x = sol
                    sols.append((k, w, n, _in_ring(cs, w, x, select)))
        for k, w, n, ring in sols:
            if evaluate(inst, k, w, n, ring, strict=True) is None:
                continue
            plan = build_plan(inst, k, w, n, ring, 0.0, strategy)
            t = predict_throughput(plan, inst, concurrency, b, g)
            if t.tpot_s < best_t.tpot_s * (1 - EPS):
                best, best_t = plan, t
    best, best_t = improve(inst, concurrency, best, best_t)
    return replace(best, solve_ms=(time.perf_counter() - t0) * 1e3), best_t


def improve(inst: Instance, concurrency: int, plan: RingPlan, t: Throughput, max_steps: int = 50
            ) -> tuple[RingPlan, Throughput]:
    """Local search on the throughput itself: move one layer between two devices (or one of a device's layers
    on or off its GPU) while that shortens the period. The ILP's period rows are a linear stand-in (a loopback
    hop counted as a link, no disk rows), so its optimum can miss the predictor's by a few layers."""
    k, strategy = plan.k, plan.strategy
    for _ in range(max_steps):
        w, n, ring = plan.window_sizes, plan.gpu_layers, list(plan.in_ring)
        moves = [(i, j) for i in range(len(w)) for j in range(len(w)) if i != j and w[i] > 0 and ring[j]]
        found = None
        for i, j in moves + [(i, None) for i in range(len(w))] + [(None, j) for j in range(len(w))]:
            w2, n2 = list(w), list(n)
            if i is not None and j is not None:  # one layer from i to j
                w2[i], w2[j] = w2[i] - 1, w2[j] + 1
                n2[i] = min(n2[i], w2[i])
            elif i is not None:  # one GPU layer of i back to its CPU
                if n2[i] == 0:
                    continue
                n2[i] -= 1
            else:  # one CPU layer of j onto its GPU
                if n2[j] >= w2[j] or k * (n2[j] + 1) > device_costs(inst)[j].gpu_cap:
                    continue
                n2[j] += 1
            if evaluate(inst, k, w2, n2, ring, strict=True) is None:
                continue
            cand = build_plan(inst, k, w2, n2, ring, 0.0, strategy)
            ct = predict_throughput(cand, inst, concurrency)
            if ct.tpot_s < (found[1] if found else t).tpot_s * (1 - EPS):
                found = (cand, ct)
        if found is None:
            break
        plan, t = found
    return plan, t
