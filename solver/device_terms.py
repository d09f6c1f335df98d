"""One device's terms per token, in numbers: its compute, whether its share fits, its reads and its streaming turns.

Everything a device costs per token is written once: here in numbers (cost_model.evaluate, the exhaustive oracle,
plan reports and the timeline read them), and in solver/device_rows.py as the ILP's rows of the same terms (Halda).
A new term is one edit in each. Symbols: cost_model's header.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.device_costs import DeviceCosts


def compute_time(c: DeviceCosts, k: int, w, n):
    """Seconds per token computing w layers a round, n of them on the GPU, and visiting the window k times when
    w > 0 (ints or numpy arrays)."""
    return k * (c.alpha * (w - n) + (c.gpu * n if c.gpu_cap else 0.0) + c.visit * (w > 0))  # no GPU: n is 0


def fits(c: DeviceCosts, k: int, w, n):
    """Whether the device's whole share stays in memory (prima.cpp's M4; ints or numpy arrays)."""
    resident = k * w if c.uma else k * (w - n)
    return resident <= c.ram_layers


def window_fits(c: DeviceCosts, w: int, n: int) -> bool:
    return (w if c.uma else w - n) <= c.ram_layers


def allowed(c: DeviceCosts, k: int, w: int, n: int) -> bool:
    """Halda's rows: the head holds its embedding and output; a Metal Mac's mmap'd share keeps one window in
    memory (or its prefetch evicts itself; other nodes stream any window through their buffers); a disk too
    slow to offload to must not be read from."""
    if c.ram < 0 or (c.uma and not window_fits(c, w, n)):
        return False
    if c.experts and not fits(c, k, w, n) and k * (w - n) * c.dense_b_prime + c.step_bytes > c.ram:
        return False  # a mixture's node keeps its dense parts and one step's experts
    return not c.forced_fit or fits(c, k, w, n)


@dataclass(frozen=True)
class Terms:
    """One device's terms per token for (k, w, n), before a streaming device's buffer is chosen."""
    label: str  # prima.cpp's set: M4 fits; short devices are M1 (macOS CPU), M2 (Metal), M3 (others); E: a
    # mixture of experts' node that caches experts (expert_terms)
    compute: float  # P_m: its layers (and, streaming with prefetch, copying its reads into the buffer)
    overflow: float | None  # O_m bytes when it streams through a buffer the plan sizes (prefetch), else None
    reads: float = 0.0  # D_m when it does not (a Metal share re-read, or loads on demand through one layer)
    inline: float = 0.0  # I_m: of those, the reads in its own turns
    turn: float = 0.0  # z_m: compute beside (with prefetch) or after (on demand) those reads
    cycle: float = 0.0  # a Metal share's re-reads: P_m + D_m must fit in TPOT - kappa (0: no such bound)


def device_terms(c: DeviceCosts, k: int, w: int, n: int, prefetch: bool = True) -> Terms:
    """A device's compute and reads per token with w layers a round (n of them on its GPU), k rounds."""
    P = compute_time(c, k, w, n)
    if fits(c, k, w, n):
        return Terms("M4", P, None, turn=P)
    if c.experts:
        return expert_terms(c, k, w, n, P)
    if c.uma:  # macOS+Metal under pressure evicts the whole share (M2): re-read every token, hidden when
        D = k * w * c.b / c.disk  # one window fits (read ahead while the ring works)
        inline = 0.0 if prefetch and window_fits(c, w, n) else D
        return Terms("M2", P, None, D, inline, max(P, inline) if prefetch else P + inline, P + D)
    label = "M1" if c.macos else "M3"
    ovf = k * (w - n) * c.b_prime - c.ram  # bytes of the share its memory cannot keep
    if not prefetch:  # loads on demand through a one-layer buffer, waiting for each read (the copy inside)
        D = (ovf + c.b) / c.disk
        return Terms(label, P, None, D, D, P + D)
    return Terms(label, P, float(ovf))  # its reads' CPU is stream_turn's (it depends on the buffer)


def expert_terms(c: DeviceCosts, k: int, w: int, n: int, P: float) -> Terms:
    """A mixture whose share does not fit (set E): the dense parts stay, the experts fill a cache of the rest of
    memory, and each layer reads its missing routed experts once its router chose them (no stream buffer, no
    gap reads). Assumed (the plan says so): routing uniform over the experts, so a cache of a share f of them
    hits f of the routed ones; the misses, (1 - f) k (w - n) top-k experts, are then top-k/E of the bytes the
    share overflows memory by. They are read beside the compute of the cached experts, but a layer's dense part
    (attention, router) comes before its reads: z = max(P + r X, X/d + k (w - n) alpha_dense)."""
    X = expert_reads(c, k, w, n)
    D = X / c.disk
    return Terms("E", P, None, D, D, max(P + c.copy * X, D + k * (w - n) * c.dense_alpha))


def expert_reads(c: DeviceCosts, k: int, w: int, n: int) -> float:
    """A mixture's expected miss bytes a token (expert_terms; 0 where its share fits or the model is dense)."""
    return c.experts * max(0, k * (w - n) * c.b_prime - c.ram)


def stream_turn(d, b, s, k: int, P, ovf, G, a=0.0, r=0.0, shared=False, cold=0.0):
    """(turns, stream buffer bytes, bytes each gap hides) of streaming devices (numpy-broadcast over devices
    or options): disk d B/s, layer b bytes, serial compute s per token, compute P, overflow ovf bytes a
    token, a cycle that may last G seconds (TPOT - kappa - its hops), a s per layer of compute, r s of CPU per
    byte read, shared: another device computes on its machine while it reads in its gaps, cold s more a
    layer's compute takes when it waited for its read; turns are inf where it cannot fit.

    The buffer is j whole layers (B = j b, j >= 1): the prefetcher reads whole matrices, and a gap fills a
    buffer of whole layers exactly with the layers that open the next window, where one of 1.65 layers took
    1.16-1.25 (the next matrix did not fit). Its k gaps hide u = k h bytes (h <= B each), the turns read
    the rest, X - u of X = ovf + B, beside the compute: its own turn is z = max(P + r (X - u), (X - u)/d + s),
    the compute losing the reader's CPU of the bytes read beside it. On a shared machine the bytes its gaps
    read slow the device computing then by r u (measured: 3 nodes on 2 cores at 1000 MB/s, a resident node
    beside two readers computed 15.0 ms a token where alone 4.8); the ring pays z + r u. A read-bound turn
    does not hide that loss: it is another device's compute. The cycle, z + u/d, must fit in G. The ring's
    share is convex in u and the cycle's feasible u an interval, so the least share lies at an end of that
    interval or where the turn's two terms meet; the turn is the least over j (the fewest layers among equal
    ones: each is read once more a token), the bytes reported hidden the fewest that give it. With k = 1 a
    gap hides what the turn would read anyway, so one layer is best. Each turn is non-increasing in G.

    A streamed layer's compute does not overlap reads: while it computes it holds its part of the buffer, and
    with one layer of buffer the reader has nowhere to read to (measured, 3 nodes at 60 %, one round: stalls
    280 ms a token, the reads the model leaves in the turn, and the 23 ms of compute beside them, not under
    them). So s grows by a per streamed layer, X/b of them a token (conservative for larger buffers). A turn
    that waits for its reads waits for (X - u)/b layers, and each starts cold (c more: the profile's streamed
    layer, which always waited), so its reads take (X - u)(1/d + c/b)."""
    d, b, s, P, ovf, G, a, r, shared, cold = np.broadcast_arrays(
        *(np.asarray(v, dtype=float) for v in (d, b, s, P, ovf, G, a, r, shared, cold)))
    # past ovf / ((k - 1) b) layers the gaps hide every read: a larger buffer only adds reads
    top = 1 if k == 1 else int(np.ceil(np.nanmax(ovf / (np.maximum(k - 1, 1) * b), initial=0.0))) + 1
    j = np.arange(1, max(top, 1) + 1).reshape((-1,) + (1,) * P.ndim)
    X = ovf + j * b
    s = s + a * X / b  # the streamed layers' compute, beside no read
    A = P + r * X  # the compute and the CPU of every byte read
    wait = 1.0 / d + cold / b  # a turn's read of a byte, the layer that waited for it starting cold
    over = X * wait + s - G  # the reads' term of the cycle, all in the turn, past G: each gap byte saves c/b
    slope = 1.0 / d - r  # what a gap's byte adds to the compute's term of the cycle
    with np.errstate(divide="ignore", invalid="ignore"):
        lo = np.maximum(np.maximum(0.0, np.where(cold > 0, over * b / cold, np.where(over > 0, np.inf, 0.0))),
                        np.where(slope < 0, (G - A) / slope, np.where((slope == 0) & (A > G), np.inf, 0.0)))
        hi = np.minimum(np.minimum(k * j * b, X), np.where(slope > 0, (G - A) / slope, np.inf))
        meet = np.where(wait != r, (X * wait + s - A) / (wait - r), lo)  # the turn's two terms equal
    ok = lo <= hi
    cand = np.stack([lo, np.clip(meet, lo, hi), hi])  # where the ring's convex share is least, in order
    with np.errstate(invalid="ignore"):  # inf bytes where it cannot fit: masked below
        share = np.maximum(A - r * cand, (X - cand) * wait + s) + shared * r * cand
    least = share.min(axis=0)
    first = (share <= least * (1 + 1e-12)).argmax(axis=0)  # the fewest gap bytes that give it
    u = np.where(ok, np.take_along_axis(cand, first[None], axis=0)[0], 0.0)
    turn = np.where(ok, least, np.inf)
    best = turn.argmin(axis=0)[None]  # the first (fewest layers) of the least
    pick = lambda v: np.take_along_axis(np.broadcast_to(v, turn.shape), best, axis=0)[0]  # noqa: E731
    return pick(turn), pick(j * b), pick(u / k)


def memory_bytes(c: DeviceCosts, k: int, w: int, n: int, extra: int) -> int:
    """Resident bytes (RAM + VRAM) the plan asks of the device, capped by what it has."""
    if c.uma:
        return min(k * w * c.b_prime, max(c.ram, 0)) + extra
    return min(k * (w - n) * c.b_prime, max(c.ram, 0)) + k * n * c.b_prime + extra

