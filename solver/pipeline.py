"""Exact pipeline makespans of heteropipe (arXiv 2610.21815) for S stages and M micro-batches."""

# Conventions: tau[s] is stage s's time per micro-batch; d[s] is the link out of stage s, so
# d[S-1] is the delivery hop from the last stage to the sink (on the ring: back to the head).
# Pass d[S-1] = 0 to get heteropipe's chain of S-1 links exactly. The delivery hop never holds a
# stage busy: it is added once in "async" and "blocking" and ignored in "free" (no
# communication). Hence sigma_{S-1} = tau_{S-1} in blocking mode, and T_async <= T_block always
# (ignoring d[S-1] in blocking mode alone would break that sandwich and overlap_ratio).

from __future__ import annotations

import math
from collections.abc import Sequence

MODES = ("free", "async", "blocking")


def _times(name: str, xs: Sequence[float]) -> list[float]:
    out = [float(x) for x in xs]
    bad = [x for x in out if not math.isfinite(x) or x < 0]
    if bad:
        raise ValueError(f"{name} must be finite and >= 0, got {bad[:3]}")
    return out


def _check(tau: Sequence[float], d: Sequence[float] | None) -> tuple[list[float], list[float]]:
    t = _times("tau", tau)
    if not t:
        raise ValueError("tau must have at least one stage")
    if d is None:
        return t, [0.0] * len(t)
    dd = _times("d", d)
    if len(dd) != len(t):
        raise ValueError(f"len(d) must equal len(tau) (d[-1] = delivery hop), got {len(dd)} and {len(t)}")
    return t, dd


def _check_m(M: int) -> None:
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"M must be an int >= 1, got {M!r}")


def sigma(tau: Sequence[float], d: Sequence[float]) -> list[float]:
    """Blocking stage times: a stage is busy until its send completes (not the delivery hop)."""
    t, dd = _check(tau, d)
    return [ts + ds for ts, ds in zip(t[:-1], dd[:-1])] + [t[-1]]


def makespan(tau: Sequence[float], d: Sequence[float] | None, M: int, mode: str) -> float:
    """Time until the M-th micro-batch reaches the sink.
    free: (M-1) max(tau) + sum(tau)                       (Theorem 1)
    async: (M-1) max(tau) + sum(tau) + sum(d)             (Theorem 2)
    blocking: (M-1) max(sigma) + sum(sigma) + d[S-1]      (Theorem 3, plus the delivery hop)"""
    t, dd = _check(tau, d)
    _check_m(M)
    if mode == "free":
        return (M - 1) * max(t) + sum(t)
    if mode == "async":
        return (M - 1) * max(t) + sum(t) + sum(dd)
    if mode == "blocking":
        s = sigma(t, dd)
        return (M - 1) * max(s) + sum(s) + dd[-1]
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def gpipe_makespan(tau: Sequence[float], M: int) -> float:
    """GPipe's homogeneous estimate (S + M - 1) max(tau)."""
    t, _ = _check(tau, None)
    _check_m(M)
    return (len(t) + M - 1) * max(t)


def homogeneity_bias(tau: Sequence[float]) -> float:
    """GPipe minus the exact free makespan: sum(max(tau) - tau_j), independent of M (Cor. 1)."""
    t, _ = _check(tau, None)
    return sum(max(t) - x for x in t)


def phase_transition(tau: Sequence[float], d: Sequence[float]) -> list[int]:
    """Links that set the blocking throughput: d_s > max(tau) - tau_s (Cor. 4); the delivery hop never does."""
    t, dd = _check(tau, d)
    top = max(t)
    return [s for s in range(len(t) - 1) if dd[s] > top - t[s]]


def overlap_ratio(tau: Sequence[float], d: Sequence[float], M: int, t_real: float) -> float:
    """rho = (T_block - T_real) / (T_block - T_async): 1 = links fully overlapped, 0 = blocking (Cor. 5)."""
    t_real = _times("t_real", [t_real])[0]
    t_block, t_async = makespan(tau, d, M, "blocking"), makespan(tau, d, M, "async")
    if t_block - t_async <= 0:
        raise ValueError("T_block == T_async here (M = 1 or no link beyond the slack): rho is undefined")
    return (t_block - t_real) / (t_block - t_async)
