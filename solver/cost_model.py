"""Cost model: the TPOT of a (k, w, n) assignment on the piped ring, from each device's terms.

Its parts: solver/device_costs.py (a device's per-layer, per-hop and per-byte costs), solver/device_terms.py (one
device's terms per token, in numbers), solver/device_rows.py (the same terms as Halda's ILP rows) and
solver/floors.py (lower bounds Halda prunes with); here the instance and a whole assignment (`evaluate`).
"""

# One token goes round the ring k times; in each round device m computes w_m layers, n_m of them
# on its GPU. Per token, with s_m = k w_m layers on m (its share):
#
#     P_m = k (alpha_m (w_m - n_m) + g_m n_m + v_m)     compute (decode is memory bound) and, when it holds
#                                                        layers, k window visits (v_m: a visit's cold start
#                                                        beyond its layers)
#     O_m = k (w_m - n_m) b' - ram_m                     bytes of the share its memory cannot keep
#     D_m = (O_m + B_m) / disk_m                         disk reads per token; B_m: its stream buffer
#     I_m = max(0, D_m - k h_m / disk_m)                 the reads its k gaps cannot hide (h_m <= B_m each)
#     z_m = max(P_m + r_m R_m, I_m + s_m)                its turns: it reads while it computes, but for
#                                                        s_m (a round's first attention, last down proj.,
#                                                        and its streamed layers: (O_m + B_m)/b alpha_m);
#                                                        a layer it waits for starts cold (c_m more each,
#                                                        I_m disk_m / b of them); its compute loses its
#                                                        reader's CPU, r_m a byte
#                                                        of R_m: the bytes of its turns (I_m disk_m), or all
#                                                        O_m + B_m where its machine's other devices compute
#                                                        while it reads in its gaps
#     TPOT = kappa + max(sum_m z_m + hops,               the ring's rounds
#                        max_m z_m + k hop_m + k h_m / disk_m)   a device's cycle: its turns, its hops,
#                                                        and k gaps long enough to read h_m
#
# This is what a node does (nodes/engine/prefetch.py): a short device keeps what its memory holds but a
# stream buffer of B_m bytes (at least one layer) resident, tensor by tensor, and streams the rest,
# O_m + B_m bytes a token, in visit order through that buffer. While the rest of the ring works
# (a gap) it can fill only the buffer, so each of its k gaps hides at most B_m of reads, and at most
# what the gap's length allows; the others are read during its own turn, beside its compute. With
# k = 1 that is the whole overflow, and a larger buffer only adds reads; with more rounds each byte
# of buffer hides k - 1 bytes more than it costs, until the gaps are too short to fill it. That is
# why PRP exists, and why B_m is the plan's choice: `evaluate` picks the best buffers for an
# assignment (exactly: TPOT is monotone in them, found by bisection), Halda's ILP picks them with
# the assignment. Without prefetch a node loads on demand
# through a one-layer buffer and waits for every read: z_m = P_m + D_m. A Metal device (uma) under
# pressure re-reads its whole share (prima.cpp's M2), hidden when one window fits.

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from prima_rpc.spec.profiles import DeviceProfile
from solver.device_costs import DeviceCosts, costs_for, layer_time
from solver.device_terms import Terms, allowed, device_terms, stream_turn
from solver.kv_term import KV_DTYPES, priced
from solver.model_profile import ModelProfile

DEFAULT_CTX = 4096  # planning context length for the KV cache when none is given


@dataclass(frozen=True)
class Instance:
    devices: tuple[DeviceProfile, ...]  # ring order, head first
    model: ModelProfile
    n_ctx: int = 0  # tokens of KV cache to reserve per layer; 0 -> min(DEFAULT_CTX, max_seq_len)
    must_stay: frozenset[str] = field(default_factory=frozenset)  # devices the ring cannot route around
    batch: int = 1  # requests computed together per step (issue 16): the costs below are per batch of this many
    kv_dtypes: tuple[str, ...] = ()  # each device's KV dtype as priced (kv_term.KV_DTYPES); (): its own, auto: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise ValueError("an instance needs at least one device")
        if not self.devices[0].is_head or any(d.is_head for d in self.devices[1:]):
            raise ValueError("the first device, and only it, must be the head")
        names = {d.name for d in self.devices}
        if len(names) != len(self.devices):
            raise ValueError("device names must be unique")
        unknown = sorted(set(self.must_stay) - names)
        if unknown:
            raise ValueError(f"must_stay names unknown devices {unknown}")
        if self.n_ctx < 0:
            raise ValueError(f"n_ctx must be >= 0, got {self.n_ctx}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {self.batch!r}")
        object.__setattr__(self, "must_stay", frozenset(self.must_stay))
        if self.n_ctx == 0:
            object.__setattr__(self, "n_ctx", min(DEFAULT_CTX, self.model.max_seq_len))
        object.__setattr__(self, "kv_dtypes", tuple(self.kv_dtypes))
        if self.kv_dtypes and (len(self.kv_dtypes) != len(self.devices) or not set(self.kv_dtypes) <= set(KV_DTYPES)):
            raise ValueError(f"kv_dtypes must name one of {KV_DTYPES} for each device, got {self.kv_dtypes}")

    @property
    def priced_kv(self) -> tuple[str, ...]:
        """Each device's KV dtype as priced: kv_dtypes, else its own (auto: float)."""
        return self.kv_dtypes or priced(d.kv_dtype for d in self.devices)

    @cached_property  # the instance is frozen; Halda asks for its costs many times
    def costs(self) -> tuple[DeviceCosts, ...]:
        return costs_for(self.devices, self.model, self.n_ctx, self.must_stay, self.batch, self.priced_kv)


def device_costs(inst: Instance) -> list[DeviceCosts]:
    return list(inst.costs)


def kappa(inst: Instance) -> float:
    """Per-token constant: the head's output projection on its CPU (measured, output_s, or its roofline; the
    embedding lookup is one row) and its own work around it (token_s: hand-offs to its compute thread,
    sampling, detokenising, the token's event). For a batch: the output layer in one pass (its batch curve),
    the head's own work per request."""
    head, m = inst.devices[0], inst.model
    output = head.output_s or layer_time(m.output_flops, m.output_weight_bytes, head.cpu_flops, head.ram_bandwidth)
    return output * head.output_batch_factor(inst.batch) + inst.batch * head.token_s


# ------------------------------------------------------------------ a whole assignment


def best_buffers(cs: list[DeviceCosts], k: int, terms: list[Terms], hops: list[float], kap: float,
                 base: float) -> tuple[float, list[float], list[float]]:
    """Least TPOT over the streaming devices' buffers, those buffers and the bytes each gap hides (0 for the
    others). hops: each device's own hops per token; base: kappa + all hops + the turns of the devices that
    do not stream. Feasibility in T is monotone (every row loosens as T grows), so bisection finds it."""
    idx = [m for m, t in enumerate(terms) if t.overflow is not None]
    bufs, hidden = [0.0] * len(cs), [0.0] * len(cs)
    if not idx:
        return base, bufs, hidden
    d, b, s = (np.array([f(cs[m]) for m in idx], dtype=float)
               for f in (lambda c: c.disk, lambda c: c.b, lambda c: k * c.serial))
    a, r, shared, cold = (np.array([f(cs[m]) for m in idx], dtype=float)
                          for f in (lambda c: c.alpha, lambda c: c.copy, lambda c: c.shared_host, lambda c: c.cold))
    P = np.array([terms[m].compute for m in idx])
    ovf = np.array([terms[m].overflow for m in idx])
    own = kap + np.array([hops[m] for m in idx])

    def ok(T: float) -> bool:
        return base + float(stream_turn(d, b, s, k, P, ovf, T - own, a, r, shared, cold)[0].sum()) <= T

    lo, hi = base, base + 1.0
    while not ok(hi):  # every row holds once T is large enough
        lo, hi = hi, 2 * hi
    for _ in range(200):
        if hi - lo <= 1e-13 * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    _, buf, h = stream_turn(d, b, s, k, P, ovf, hi - own, a, r, shared, cold)
    for j, m in enumerate(idx):
        bufs[m], hidden[m] = float(buf[j]), float(h[j])
    return hi, bufs, hidden



@dataclass(frozen=True)
class Breakdown:
    """The cost model's terms of one assignment, per token (device tuples in ring order, head first).
    TPOT = max(ring_s, max cycle_s); ring_s = kappa + sum(turn_s) + sum(hop_s)."""
    tpot_s: float
    compute_s: tuple[float, ...]  # P_m
    disk_s: tuple[float, ...]  # D_m
    hop_s: tuple[float, ...]  # k hop_m for ring members (when the ring has >= 2), else 0
    visit_s: tuple[float, ...]  # k v_m for devices that hold layers (inside compute_s), else 0
    inline_s: tuple[float, ...]  # I_m: the reads in the device's own turns (beside its compute when prefetching)
    read_cpu_s: tuple[float, ...]  # what its reads cost the compute (streaming devices; read_loss_s, else their CPU)
    serial_s: tuple[float, ...]  # s_m: compute its turns' reads cannot overlap (streaming devices, else 0)
    # z_m: its turns, compute and the reads it cannot hide; on a shared machine also its gap reads' loss, which the
    # devices computing during its gaps take (charged here: the ring's sum is right, a node's own time is less)
    turn_s: tuple[float, ...]
    cycle_s: tuple[float, ...]  # kappa + its turns, hops and the gaps its reads ahead need (0: no reads)
    buffer_bytes: tuple[int, ...]  # B_m: the stream buffer of each streaming device (0: it does not stream)
    labels: tuple[str, ...]
    ring_s: float  # kappa + the turns + hops
    kappa_s: float
    prefetch: bool = True

    @property
    def stage_s(self) -> tuple[float, ...]:
        """A device's busy time per token but its hops: compute beside its reads (after them on demand),
        and the head's constant."""
        both = (max(p + r, x) if self.prefetch else p + x
                for p, r, x in zip(self.compute_s, self.read_cpu_s, self.disk_s))
        return tuple(t + (self.kappa_s if m == 0 else 0.0) for m, t in enumerate(both))

    @property
    def busy_s(self) -> tuple[float, ...]:
        return tuple(t + h for t, h in zip(self.stage_s, self.hop_s))

    @property
    def terms_s(self) -> dict[str, float]:
        """TPOT as a sum: compute (the layers), visits (each window visit's cold start beyond its layers), reads
        (the compute their CPU takes, and what outlasts the compute they run beside), hops, head (kappa) and
        wait (a device's cycle longer than the ring's round)."""
        compute, visits = sum(self.compute_s), sum(self.visit_s)
        return {"compute": compute - visits, "visits": visits, "reads": sum(self.turn_s) - compute,
                "hops": sum(self.hop_s), "head": self.kappa_s, "wait": self.tpot_s - self.ring_s}


def check_assignment(inst: Instance, k: int, w: list[int], n: list[int]) -> None:
    L, M = inst.model.n_layers, len(inst.devices)
    if len(w) != M or len(n) != M:
        raise ValueError(f"w and n need {M} entries, got {len(w)} and {len(n)}")
    if k < 1 or k * sum(w) != L:
        raise ValueError(f"k * sum(w) must equal L={L}, got k={k}, sum(w)={sum(w)}")
    for c, wm, nm in zip(device_costs(inst), w, n):
        if not 0 <= nm <= wm:
            raise ValueError(f"{c.name}: need 0 <= n <= w, got w={wm}, n={nm}")
        if k * nm > c.gpu_cap:
            raise ValueError(f"{c.name}: {k * nm} GPU layers exceed its VRAM ({c.gpu_cap} layers)")


def evaluate(inst: Instance, k: int, w: list[int], n: list[int], in_ring: list[bool] | None = None,
             prefetch: bool = True, strict: bool = False) -> Breakdown | None:
    """TPOT of an assignment, with the best stream buffers. strict: return None where Halda's rows forbid
    it (window does not fit, slow disk overflows, head cannot hold its embedding/output)."""
    check_assignment(inst, k, w, n)
    cs = device_costs(inst)
    if in_ring is None:
        in_ring = [wm > 0 or not c.routable for c, wm in zip(cs, w)]
    talks = sum(in_ring) >= 2  # a ring of one device sends nothing over the network
    terms = []
    for c, wm, nm, r in zip(cs, w, n, in_ring):
        if wm and not r:
            raise ValueError(f"{c.name} holds layers but is not in the ring")
        if strict and not allowed(c, k, wm, nm):
            return None
        terms.append(device_terms(c, k, wm, nm, prefetch))
    H = [k * c.hop if r and talks else 0.0 for c, r in zip(cs, in_ring)]
    kap = kappa(inst)
    tpot, buf, hidden = best_buffers(cs, k, terms, H, kap, kap + sum(H) + sum(t.turn for t in terms))
    D, inline, cpu, serial, turn, cycle = [], [], [], [], [], []
    for c, t, bm, h, hm in zip(cs, terms, buf, hidden, H):
        if t.overflow is None:
            D.append(t.reads)
            inline.append(t.inline)
            cpu.append(0.0)
            serial.append(0.0)
            turn.append(t.turn)
            cycle.append(kap + t.cycle if t.cycle else 0.0)
        else:  # the stream_turn it was sized by
            D.append((t.overflow + bm) / c.disk)
            inline.append(max(0.0, D[-1] - k * h / c.disk))
            cpu.append((t.overflow + bm) * c.copy)
            waited = inline[-1] * c.disk / c.b  # layers its turns wait for: each starts cold
            serial.append(k * c.serial + c.alpha * (t.overflow + bm) / c.b + c.cold * waited)
            own = max(t.compute + inline[-1] * c.disk * c.copy, inline[-1] + serial[-1])
            turn.append(own + (k * h * c.copy if c.shared_host else 0.0))  # its gaps' reads slow a neighbour
            cycle.append(kap + own + hm + k * h / c.disk)
    ring = kap + sum(turn) + sum(H)
    tpot = max([tpot, ring] + cycle)
    V = tuple(k * c.visit if wm else 0.0 for c, wm in zip(cs, w))
    return Breakdown(tpot, tuple(t.compute for t in terms), tuple(D), tuple(H), V, tuple(inline), tuple(cpu),
                     tuple(serial), tuple(turn), tuple(cycle), tuple(int(round(b)) for b in buf),
                     tuple(t.label if r else "-" for t, r in zip(terms, in_ring)), ring, kap, prefetch)
