"""Halda: the layer-to-device assignment of prima.cpp as one small ILP per k on python-mip."""

# For a fixed k (W = L/k) the TPOT of cost_model is linear in the ILP's variables, so Halda
# enumerates the divisors k of L, solves one ILP each and keeps the best plan. Equation numbers
# are those of prima.cpp's paper (ICLR 2026): (6) objective, (7) 0 <= n <= w, (8) sum w = W,
# (28)-(33) RAM rows of the sets M1-M4, (35)-(37) VRAM rows. A device's own rows are written in
# device_rows.device_rows, term by term as device_terms computes them.
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
#   turn_m >= P_m + r_m v_m, v_m + s_m o_m (s_m: the compute its reads cannot overlap; r_m: the compute's
#   loss per byte read beside it); on a shared machine the ring also pays r_m k h_m, the gap bytes' loss to
#   the device computing then; and its cycle, its turns + hops + k gaps of h_m, bounds T.
# - Exact and fast (issue 18): no ILP is solved that cannot win. First the best k = 1 plan in which
#   every share fits in memory, by a DP over devices (nothing is read, so TPOT is a sum of per-device
#   terms: fitting_optimum); a k > 1 plan that reads nothing cannot beat it. Then only a plan where
#   some device reads from disk can win, and that device's cycle is at least its offload floor, which
#   grows with k; where no device's floor is below the best so far, that is the optimum (on D1-D4
#   clusters of 32 and 64 devices, no ILP at all). Otherwise one ILP per k, with the best plan so far as
#   its cutoff, no offload rows for devices whose floor is past it, and the k loop ends when the
#   floors, or the reads of what no memory holds (reads_floor), outlast the best plan. HiGHS through
#   python-mip measured 3-5x slower than CBC on these ILPs, so CBC it is.

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import mip
import numpy as np

from prima_rpc.spec.windows import layer_ranges
from solver.cost_model import Instance, device_costs, evaluate, kappa
from solver.device_costs import DeviceCosts
from solver.device_rows import device_rows
from solver.device_terms import compute_time, fits
from solver.floors import offload_floor, reads_floor
from solver.plan import Infeasible, RingPlan, build_plan

__all__ = ["halda", "build_model", "solve", "extract_plan", "layer_ranges", "divisors"]

EPS = 1e-9  # relative: plans closer than this are ties


def solver_name() -> str:
    """CBC: HiGHS through python-mip (highspy + highsbox) measured 3-5x slower on these ILPs (issue 18)."""
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


def new_model() -> mip.Model:
    """An empty CBC model set for these tiny ILPs, solved exactly."""
    model = mip.Model(sense=mip.MINIMIZE, solver_name=solver_name())
    model.verbose = 0
    model.threads = 1
    model.cuts = 0  # these ILPs are tiny: CBC's cut rounds cost more than they prune (2-5x here)
    model.max_mip_gap, model.max_mip_gap_abs = 1e-9, 1e-12  # exact: tests compare with enumeration
    return model


def window_caps(cs: list[DeviceCosts], k: int, W: int, bound_s: float) -> tuple[list[bool], list[int]]:
    """(must fit, window cap) per device. Caps: memory (a window fits in RAM + VRAM; the share, where the device
    must fit: when its disk is too slow to offload to, or reading from it would cost more than bound_s) and time
    (P_m <= T < bound_s)."""
    fit = [must_fit(c, bound_s, k) for c in cs]
    cap = [min(W, c.ram_layers // k + (0 if c.uma else c.gpu_cap // k)) if f else
           min(W, c.ram_layers + c.gpu_cap // k) if c.uma else W for c, f in zip(cs, fit)]
    if math.isfinite(bound_s):
        cap = [min(u, int(bound_s * (1 + EPS) / (k * min(c.alpha, c.gpu)))) for u, c in zip(cap, cs)]
    return fit, cap


def head_talks(model: mip.Model, x: list[mip.Var | float]) -> mip.Var | float:
    """Whether the head sends: its hop is paid only if someone else is in the ring (talk >= x_m)."""
    if len(x) == 1:
        return 0.0
    if any(not isinstance(v, mip.Var) for v in x[1:]):
        return 1.0
    talk = model.add_var("talk", lb=0.0, ub=1.0)
    for m in range(1, len(x)):
        model += talk >= x[m], f"talk({m})"
    return talk


def period_rows(model: mip.Model, inst: Instance, k: int, turns: list, x_hop: list, T: mip.Var, unit: float,
                micro_batches: int) -> None:
    """Issue 16: T + kappa is at least the busiest resource's work for all micro_batches batches in flight: each
    host's CPU (its devices' turns, the head's kappa) and each link (a loopback hop counted as a link here)."""
    cs = device_costs(inst)
    kap = kappa(inst) / unit
    hosts: dict[str, list[int]] = {}
    for m in range(len(cs)):
        hosts.setdefault(inst.devices[m].host or f"\0{m}", []).append(m)
    for i, ms in enumerate(hosts.values()):
        model += T >= micro_batches * (mip.xsum(turns[m] for m in ms) + (kap if 0 in ms else 0.0)) - kap, \
            f"period_cpu({i})"
    for m in range(len(cs)):
        model += T >= micro_batches * k * cs[m].hop / unit * x_hop[m] - kap, f"period_link({m})"


def build_model(inst: Instance, k: int, select: bool = True, bound_s: float = math.inf,
                micro_batches: int = 1) -> Lda:
    """The LDA for a fixed k. select=False: every device stays and computes >= 1 layer if it can.
    bound_s: only plans with T below it are wanted (lets slow devices' windows be capped).
    micro_batches > 1 (issue 16): T + kappa is the period of that many batches in flight (solver/throughput.py),
    at least each host's CPU and each link times micro_batches."""
    cs = device_costs(inst)
    W = inst.model.n_layers // k
    Ms = range(len(cs))
    unit = time_unit(inst, cs)
    model = new_model()
    fit, cap = window_caps(cs, k, W, bound_s)
    w = [model.add_var(f"w({m})", var_type=mip.INTEGER, lb=0, ub=max(cap[m], 0)) for m in Ms]
    n: list[mip.Var | float] = [  # (35)-(37): VRAM bounds the GPU share k n_m; no GPU -> n_m = 0
        model.add_var(f"n({m})", var_type=mip.INTEGER, lb=0, ub=min(W, cs[m].gpu_cap // k))
        if cs[m].gpu_cap >= k else 0.0 for m in Ms]
    x: list[mip.Var | float] = [
        model.add_var(f"x({m})", var_type=mip.BINARY) if select and cs[m].routable else 1.0 for m in Ms]
    T = model.add_var("T", lb=0.0)
    x_hop = [head_talks(model, x)] + x[1:]

    model += mip.xsum(w) == W, "eq8_window_sum"
    for m in Ms:
        c = cs[m]
        if isinstance(n[m], mip.Var):
            model += n[m] <= w[m], f"eq7_n_le_w({m})"
        if isinstance(x[m], mip.Var):  # device selection: layers only on ring members
            model += w[m] <= max(cap[m], 0) * x[m], f"ring({m})"
        elif not select and c.ram_layers + c.gpu_cap // k >= 1:
            model += w[m] >= 1, f"keep({m})"  # prima.cpp without selection: every device computes
    turns = [device_rows(model, cs[m], k, W, m, w[m], n[m], x_hop[m], T, unit, not fit[m],
                         x[m] if isinstance(x[m], mip.Var) else None) for m in Ms]  # w > 0 forces x = 1
    model += T >= mip.xsum(turns) + mip.xsum(k * cs[m].hop / unit * x_hop[m] for m in Ms), "eq6_ring"
    if micro_batches > 1:
        period_rows(model, inst, k, turns, x_hop, T, unit, micro_batches)
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
                 select: bool = True) -> RingPlan:
    in_ring = _in_ring(device_costs(inst), w, x, select)
    return build_plan(inst, k, w, n, in_ring, solve_ms, "halda" if select else "halda-noselect")


def _tpot(inst: Instance, k: int, w: list[int], n: list[int], x: list[bool], select: bool) -> float:
    br = evaluate(inst, k, w, n, _in_ring(device_costs(inst), w, x, select), strict=True)
    return br.tpot_s if br else math.inf


def must_fit(c: DeviceCosts, bound_s: float, k: int = 1) -> bool:
    """Whether every wanted k-round plan keeps the device's whole share in memory: its disk is too slow to
    offload to, or reading from it costs at least bound_s (TPOT - kappa) in any plan (floors.offload_floor)."""
    return c.forced_fit or c.ram_layers < 0 or offload_floor(c, k) >= bound_s


def fit_options(c: DeviceCosts, k: int, W: int, select: bool) -> tuple[np.ndarray, np.ndarray]:
    """The device's least compute for each window w = 0..W in which its share fits (inf: none fits), and the GPU
    layers that give it."""
    ws, ns = np.arange(W + 1)[:, None], np.arange(W + 1)[None, :]
    n = ns[:, : min(W, c.gpu_cap // k) + 1]
    P = np.where((n <= ws) & fits(c, k, ws, n) & (c.ram >= 0), compute_time(c, k, ws, n), np.inf)
    best = P.argmin(axis=1)
    cost = P[np.arange(W + 1), best]
    if not select and c.ram_layers + c.gpu_cap // k >= 1:
        cost[0] = np.inf  # prima.cpp without selection: every device that can compute does
    return cost, best


def fit_dp(cs: list[DeviceCosts], k: int, W: int, select: bool) -> tuple[np.ndarray, list]:
    """The DP over the devices after the head, in ring order: dp[t][s], the least compute + hops of the devices
    so far holding s layers (t: whether one of them stays), and each device's step to trace it back."""
    shift = np.arange(W + 1)[:, None] - np.arange(W + 1)[None, :]  # [s, w]: layers left for the others
    valid = shift >= 0
    shift = np.where(valid, shift, 0)
    dp = np.full((2, W + 1), np.inf)
    dp[0, 0] = 0.0
    steps = []
    for c in cs:
        cost, best_n = fit_options(c, k, W, select)
        leaves = select and c.routable
        stay = cost + k * c.hop  # a member pays its hop (a relay too: w = 0 when it cannot leave)
        if leaves:
            stay[0] = np.inf  # with no layers it leaves the ring
        prev = np.minimum(dp[0], dp[1])
        cand = np.where(valid, prev[shift] + stay[None, :], np.inf)  # [s, w]
        w_at = cand.argmin(axis=1)
        joined = cand[np.arange(W + 1), w_at]
        new = np.full((2, W + 1), np.inf)
        new[0] = dp[0] if leaves else np.inf
        new[1] = np.minimum(joined, dp[1]) if leaves else joined
        # how each new[1][s] was reached: (w, from t) staying, or (-1, 1) leaving
        rest = np.arange(W + 1) - w_at
        from_t = np.where(dp[0][rest] <= dp[1][rest], 0, 1)
        took_stay = joined <= (dp[1] if leaves else np.inf)
        steps.append((w_at, best_n, from_t, took_stay))
        dp = new
    return dp, steps


def fit_trace(steps: list, t: int, s: int) -> list[tuple[int, int, bool]]:
    """(w, n, stays) of each device of fit_dp, in ring order, from its end state: t, s layers held."""
    back = []
    for w_at, best_n, from_t, took_stay in reversed(steps):
        if t == 1 and took_stay[s]:
            wm = int(w_at[s])
            back.append((wm, int(best_n[wm]), True))
            s, t = s - wm, int(from_t[s])
        else:  # it left the ring (t unchanged)
            back.append((0, 0, False))
    return back[::-1]


def fitting_optimum(cs: list[DeviceCosts], k: int, W: int, select: bool):
    """(T, w, n, x): the least TPOT - kappa over the plans for this k in which every share fits its device's
    memory, exactly; None when there is none. Nothing is read from disk, so T is the sum of the members' compute
    and hops (device_terms.compute_time, fits): separable, a DP over devices in ring order solves it (O(M W^2)).

    Halda takes it where the bounds leave no device room to offload: there the ILP's optimum is this one."""
    dp, steps = fit_dp(cs[1:], k, W, select)
    head = cs[0]
    cost0, n0 = fit_options(head, k, W, select)
    total = np.full((2, W + 1), np.inf)  # [t, w0]
    for t in (0, 1):
        total[t] = dp[t][W - np.arange(W + 1)] + cost0 + (k * head.hop if t else 0.0)
    t, w0 = np.unravel_index(np.argmin(total), total.shape)
    if not np.isfinite(total[t, w0]):
        return None
    rest = fit_trace(steps, int(t), W - int(w0))
    return (float(total[t, w0]), [int(w0)] + [wm for wm, _, _ in rest], [int(n0[w0])] + [nm for _, nm, _ in rest],
            [True] + [xm for _, _, xm in rest])


def halda(inst: Instance, select: bool = True) -> RingPlan | Infeasible:
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
    # Incumbent: the best k = 1 plan in which nothing is read from disk (exact, by DP). A k > 1 plan where
    # nothing offloads maps to a k = 1 plan with (k - 1) fewer hop rounds, so it cannot beat this one.
    best, best_k, best_sol = math.inf, 1, None
    fit1 = fitting_optimum(cs, 1, L, select)
    if fit1 is not None:
        best_sol = fit1[1:]
        best = _tpot(inst, 1, *best_sol, select)
    for k in divisors(L):
        # Bounds: every layer costs >= r_min and every fixed ring member pays k hops; and only plans that
        # offload can beat the fitting optimum, each at least its offloading device's floor, which grows with
        # k: where the bound leaves no device room to offload, the best plan so far is the optimum.
        if kap + L * r_min + k * hop_fixed >= best * (1 - EPS):
            break  # this bound grows with k
        if math.isfinite(best) and all(must_fit(c, (best - kap) * (1 - EPS), k) for c in cs):
            break  # no device can offload in a better plan, at this k or any larger one
        if kap + reads_floor(cs, k, L) >= best * (1 - EPS):
            break  # what memory cannot hold takes longer to read (grows with k)
        sol = solve(build_model(inst, k, select, best - kap), (best - kap) * (1 + EPS))
        val = _tpot(inst, k, *sol, select) if sol else math.inf
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
