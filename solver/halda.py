"""Halda: the layer-to-device assignment of prima.cpp as one small ILP per k on python-mip."""

# For a fixed k (W = L/k) the TPOT of cost_model is linear in the ILP's variables, so Halda
# enumerates the divisors k of L, solves one ILP each and keeps the best plan. Equation numbers
# are those of prima.cpp's paper (ICLR 2026): (6) objective, (7) 0 <= n <= w, (8) sum w = W,
# (28)-(33) RAM rows of the sets M1-M4, (35)-(37) VRAM rows. A device's own rows are written beside
# its terms in cost_model.device_rows.
#
# Where this differs from prima.cpp, and why:
# - Sets are chosen inside the ILP instead of by prima.cpp's iterate-and-calibrate loop. M1/M3
#   rows take the max form y_m >= (k(w-n)b' - ram)/disk, y_m >= 0: prima's coefficients
#   a = alpha + b'/disk, b = beta - b'/disk when short, M4's when the share fits. A Metal device
#   (M2 vs M4: macOS evicts the whole share when short, a jump in cost) gets one binary z_m.
#   Each per-k ILP is then exact over all set assignments, so the set loop is at its fixed point
#   after one solve and calibration has nothing left to fix. The loop version was slower (one
#   extra solve per flip) and path-dependent (it missed a 1.2 % better k=2 plan on an 8-device
#   cluster); tests check every plan against exhaustive search.
# - Device selection is in the ILP too: x_m = 1 keeps device m in the ring and pays its hop. A
#   device prima.cpp would drop (w = 0, or w = 1 when dropping it is faster) gets x_m = 0 directly,
#   so re-running on the rest cannot do better. The head and `must_stay` devices keep x_m = 1 and,
#   with no layers, become relays (the head stays head with window 0: it embeds and samples).
# - A device's disk loads overlap the rest of the ring (cost_model's max), which is what makes k > 1
#   pay off. prima.cpp requires every window to fit in memory (else its mmap prefetch evicts what it
#   just loaded); a node here streams through buffers it never evicts from, so only Metal Macs (whose
#   model is still prima.cpp's) keep that row.
# - Loads as a node makes them (cost_model): a short device (binary o_m: it streams at all) also
#   reads its stream buffer's bytes (e_m: their read time, >= one layer's, chosen by the ILP); each
#   gap hides h_m <= e_m, what they cannot, v_m >= y_m + e_m - k h_m, is read beside its compute,
#   turn_m >= P_m, v_m + s_m o_m (s_m: the compute its reads cannot overlap); and its cycle, turns +
#   hops + k gaps of h_m, bounds T.

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass
from functools import lru_cache

import mip

from solver.cost_model import DeviceCosts, Instance, device_costs, device_rows, evaluate, kappa
from solver.plan import Infeasible, Plan, build_plan, layer_ranges

__all__ = ["halda", "build_model", "solve", "extract_plan", "layer_ranges", "divisors"]

EPS = 1e-9  # relative: plans closer than this are ties


@lru_cache(maxsize=1)
def solver_name() -> str:
    """HiGHS when python-mip can load it (prima.cpp uses HiGHS), else CBC."""
    if importlib.util.find_spec("highspy") is None:  # skip mip's noisy failed load
        return mip.CBC
    try:
        mip.Model(solver_name=mip.HIGHS)
        return mip.HIGHS
    except Exception:  # python-mip raises FileNotFoundError/ImportError variants when HiGHS is absent
        return mip.CBC


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def time_unit(inst: Instance, cs: list[DeviceCosts]) -> float:
    """A TPOT scale in seconds: every layer on the fastest unit plus the head's constant."""
    r_min = min(min(c.alpha, c.gpu if c.gpu_cap else math.inf) for c in cs)
    return kappa(inst) + inst.model.n_layers * r_min


@dataclass
class Lda:
    """One fixed-k ILP and its variables (index m runs over devices in ring order)."""
    model: mip.Model
    k: int
    unit: float  # seconds per objective unit (keeps coefficients near 1 for CBC's tolerances)
    w: list[mip.Var]
    n: list[mip.Var | float]
    x: list[mip.Var | float]


def build_model(inst: Instance, k: int, select: bool = True, bound_s: float = math.inf) -> Lda:
    """The LDA for a fixed k. select=False: every device stays and computes >= 1 layer if it can.
    bound_s: only plans with T below it are wanted (lets slow devices' windows be capped)."""
    cs = device_costs(inst)
    W = inst.model.n_layers // k
    Ms = range(len(cs))
    unit = time_unit(inst, cs)
    model = mip.Model(sense=mip.MINIMIZE, solver_name=solver_name())
    model.verbose = 0
    model.threads = 1
    model.cuts = 0  # these ILPs are tiny: CBC's cut rounds cost more than they prune (2-5x here)
    model.max_mip_gap, model.max_mip_gap_abs = 1e-9, 1e-12  # exact: tests compare with enumeration

    # Window caps: memory (a window fits in RAM + VRAM) and time (P_m <= T < bound_s).
    cap = [min(W, c.ram_layers + c.gpu_cap // k) if c.uma or c.forced_fit or c.ram_layers < 0 else W for c in cs]
    if math.isfinite(bound_s):
        cap = [min(u, int(bound_s * (1 + EPS) / (k * min(c.alpha, c.gpu)))) for u, c in zip(cap, cs)]
    w = [model.add_var(f"w({m})", var_type=mip.INTEGER, lb=0, ub=max(cap[m], 0)) for m in Ms]
    n: list[mip.Var | float] = [  # (35)-(37): VRAM bounds the GPU share k n_m; no GPU -> n_m = 0
        model.add_var(f"n({m})", var_type=mip.INTEGER, lb=0, ub=min(W, cs[m].gpu_cap // k))
        if cs[m].gpu_cap >= k else 0.0 for m in Ms]
    x: list[mip.Var | float] = [
        model.add_var(f"x({m})", var_type=mip.BINARY) if select and cs[m].routable else 1.0 for m in Ms]
    T = model.add_var("T", lb=0.0)
    # The head's hop is paid only if someone else is in the ring: talk >= x_m.
    if len(cs) == 1:
        talk: mip.Var | float = 0.0
    elif any(not isinstance(v, mip.Var) for v in x[1:]):
        talk = 1.0
    else:
        talk = model.add_var("talk", lb=0.0, ub=1.0)
        for m in Ms[1:]:
            model += talk >= x[m], f"talk({m})"
    x_hop = [talk] + x[1:]

    model += mip.xsum(w) == W, "eq8_window_sum"
    for m in Ms:
        c = cs[m]
        if isinstance(n[m], mip.Var):
            model += n[m] <= w[m], f"eq7_n_le_w({m})"
        if isinstance(x[m], mip.Var):  # device selection: layers only on ring members
            model += w[m] <= max(cap[m], 0) * x[m], f"ring({m})"
        elif not select and c.ram_layers + c.gpu_cap // k >= 1:
            model += w[m] >= 1, f"keep({m})"  # prima.cpp without selection: every device computes
    turns = [device_rows(model, cs[m], k, W, m, w[m], n[m], x_hop[m], T, unit) for m in Ms]  # and their rows
    model += T >= mip.xsum(turns) + mip.xsum(k * cs[m].hop / unit * x_hop[m] for m in Ms), "eq6_ring"
    model.objective = mip.minimize(T)  # (6): TPOT = kappa + T
    return Lda(model, k, unit, w, n, x)


def solve(lda: Lda, cutoff_s: float = math.inf) -> tuple[list[int], list[int], list[bool]] | None:
    """Optimise; None when infeasible (or nothing reaches below cutoff_s, in seconds of T)."""
    if math.isfinite(cutoff_s):
        lda.model.cutoff = cutoff_s / lda.unit
    status = lda.model.optimize()
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        return None

    def val(v: mip.Var | float) -> int:
        return int(round(v.x)) if isinstance(v, mip.Var) else int(v)

    return [val(v) for v in lda.w], [val(v) for v in lda.n], [val(v) == 1 for v in lda.x]


def _in_ring(cs: list[DeviceCosts], w: list[int], x: list[bool], select: bool) -> list[bool]:
    # With selection a device with no layers leaves the ring unless it cannot be routed
    # around (then: relay); without selection every device stays.
    return [xm and (wm > 0 or not c.routable or not select) for c, wm, xm in zip(cs, w, x)]


def extract_plan(inst: Instance, k: int, w: list[int], n: list[int], x: list[bool], solve_ms: float,
                 select: bool = True) -> Plan:
    in_ring = _in_ring(device_costs(inst), w, x, select)
    return build_plan(inst, k, w, n, in_ring, solve_ms, "halda" if select else "halda-noselect")


def _tpot(inst: Instance, k: int, w: list[int], n: list[int], x: list[bool], select: bool) -> float:
    br = evaluate(inst, k, w, n, _in_ring(device_costs(inst), w, x, select), strict=True)
    return br.tpot_s if br else math.inf


def _incumbents(inst: Instance, cs: list[DeviceCosts], select: bool):
    """Cheap k = 1 plans whose TPOT becomes the solver's cutoff: everything on one device, and
    a greedy fill of the fastest memory (GPU, then RAM) without offloading."""
    L, M = inst.model.n_layers, len(cs)
    cands = []
    for m in range(M) if select else ([0] if M == 1 else []):
        w = [L if i == m else 0 for i in range(M)]
        cands.append((w, [min(L, cs[m].gpu_cap) if i == m else 0 for i in range(M)]))
    if select:
        blocks = []  # (seconds per layer, device, layers, on GPU)
        for m, c in enumerate(cs):
            gpu = min(c.gpu_cap, max(c.ram_layers, 0)) if c.uma else c.gpu_cap
            blocks += [(c.gpu, m, gpu, True), (c.alpha, m, max(c.ram_layers, 0) - (gpu if c.uma else 0), False)]
        w, n, left = [0] * M, [0] * M, L
        for _, m, size, on_gpu in sorted(blocks):
            take = min(size, left)
            w[m] += take
            n[m] += take if on_gpu else 0
            left -= take
        if left == 0:
            cands.append((w, n))
    best, best_sol = math.inf, None
    for w, n in cands:
        x = [wm > 0 or not c.routable for c, wm in zip(cs, w)]
        val = _tpot(inst, 1, w, n, x, select)
        if val < best:
            best, best_sol = val, (w, n, x)
    return best, best_sol


def _offload_floor(c: DeviceCosts) -> float:
    """Least cycle (TPOT - kappa) of device m in any state where it offloads to disk (any k)."""
    if c.forced_fit or c.ram_layers < 0:
        return math.inf
    s = c.ram_layers + 1  # first share that no longer fits
    if c.uma:
        return s * (min(c.alpha, c.gpu) + c.b / c.disk)
    return max(s * c.alpha, (s * c.b_prime - c.ram + c.b) / c.disk + c.serial)  # compute; reads + serial


def halda(inst: Instance, select: bool = True) -> Plan | Infeasible:
    """Best plan over all k dividing L; select=False keeps every device (prima.cpp's Halda
    before device selection)."""
    t0 = time.perf_counter()
    cs = device_costs(inst)
    head, L = cs[0], inst.model.n_layers
    if head.ram < 0:
        return Infeasible(f"head {head.name} cannot hold the embedding and output "
                          f"({inst.model.head_extra_bytes} B > {inst.devices[0].ram_available} B available)")
    kap = kappa(inst)
    r_min = min(min(c.alpha, c.gpu if c.gpu_cap else math.inf) for c in cs)
    fixed = [c for c in cs if not (select and c.routable)]
    hop_fixed = sum(c.hop for c in fixed) if len(fixed) >= 2 else 0.0
    offload_min = kap + min(_offload_floor(c) for c in cs)
    best, best_sol = _incumbents(inst, cs, select)
    best_k, opt1 = 1, math.inf
    for k in divisors(L):
        # Bounds: every layer costs >= r_min and every fixed ring member pays k hops; and a
        # k-plan where nothing offloads maps to a k=1 plan with (k-1) fewer hop rounds, so for
        # k > 1 only plans that offload (>= offload_min) can beat the k=1 optimum.
        if kap + L * r_min + k * hop_fixed >= best * (1 - EPS):
            break  # this bound grows with k
        if k > 1 and min(opt1 + (k - 1) * hop_fixed, offload_min) >= best * (1 - EPS):
            continue
        sol = solve(build_model(inst, k, select, best - kap), (best - kap) * (1 + EPS))
        val = _tpot(inst, k, *sol, select) if sol else math.inf
        if k == 1:
            opt1 = min(val, best)
        if val < best * (1 - EPS):
            best, best_k, best_sol = val, k, sol
    ms = (time.perf_counter() - t0) * 1e3
    if best_sol is None:
        need = inst.model.total_bytes / 2**30
        have = sum(d.ram_available + d.vram_free for d in inst.devices) / 2**30
        return Infeasible(f"no assignment fits for any k: total memory + disk cannot hold the model "
                          f"(model {need:.1f} GiB, RAM+VRAM {have:.1f} GiB; an offloading device must "
                          f"hold one window, a device with disk < 0.1 GB/s its whole share)", ms)
    return extract_plan(inst, best_k, *best_sol, solve_ms=ms, select=select)
