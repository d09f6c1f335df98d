"""Cost model: per-device per-layer times and the TPOT of a (k, w, n) assignment on the piped ring."""

# One token goes round the ring k times; in each round device m computes w_m layers, n_m of them
# on its GPU. Per token, with s_m = k w_m layers on m (its share):
#
#     P_m = k (alpha_m (w_m - n_m) + g_m n_m)           compute (decode is memory bound), plus, when it
#                                                        streams, copying O_m + b into its buffer
#     O_m = k (w_m - n_m) b' - ram_m                     bytes of the share its memory cannot keep
#     D_m = (O_m + B_m) / disk_m                         disk reads per token; B_m: its stream buffer
#     I_m = max(0, D_m - k h_m / disk_m)                 the reads its k gaps cannot hide (h_m <= B_m each)
#     z_m = max(P_m, I_m + s_m)                          its turns: it reads while it computes, but for
#                                                        s_m (a round's first attention, last down proj.)
#     TPOT = kappa + max(sum_m z_m + hops,               the ring's rounds
#                        max_m z_m + k hop_m + k h_m / disk_m)   a device's cycle: its turns, its hops,
#                                                        and k gaps long enough to read h_m
#
# This is what a node does (nodes/prefetch.py): a short device keeps what its memory holds but a
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

import math
from dataclasses import dataclass, field
from functools import lru_cache

from solver.model_profile import ModelProfile
from solver.profiles import DeviceProfile

SLOW_DISK = 0.1e9  # B/s; below this prima.cpp forbids offloading (the device must fit, M4)
DEFAULT_CTX = 4096  # planning context length for the KV cache when none is given


@dataclass(frozen=True)
class Instance:
    devices: tuple[DeviceProfile, ...]  # ring order, head first
    model: ModelProfile
    n_ctx: int = 0  # tokens of KV cache to reserve per layer; 0 -> min(DEFAULT_CTX, max_seq_len)
    must_stay: frozenset[str] = field(default_factory=frozenset)  # devices the ring cannot route around

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))  # hashable: costs are cached per instance
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
        object.__setattr__(self, "must_stay", frozenset(self.must_stay))
        if self.n_ctx == 0:
            object.__setattr__(self, "n_ctx", min(DEFAULT_CTX, self.model.max_seq_len))


@dataclass(frozen=True)
class DeviceCosts:
    name: str
    is_head: bool
    routable: bool  # may leave the ring (not head, not in must_stay)
    uma: bool  # Metal: GPU layers share the RAM pool, and macOS evicts all of it when short
    macos: bool
    forced_fit: bool  # disk too slow to offload to
    alpha: float  # s per layer per token on the CPU
    gpu: float  # s per layer per token on the GPU (inf without one)
    hop: float  # s for one activation to its successor
    disk: float  # B/s sequential read
    b: int  # layer bytes
    b_prime: int  # layer bytes + its KV cache
    ram: int  # RAM bytes left for layers (the head's embedding/output taken off)
    ram_layers: int  # floor(ram / b'): layers that fit in RAM
    gpu_cap: int  # layers that fit in VRAM (0 without a GPU)
    serial: float = 0.0  # s per round of compute a streaming turn cannot overlap with its reads
    copy: float = 0.0  # s per byte read: the reader copies it into the buffer, beside the compute (1 / RAM B/s)

    @property
    def beta(self) -> float:
        return self.gpu - self.alpha if self.gpu_cap else 0.0


def layer_time(flops: float, nbytes: float, flop_rate: float, bandwidth: float) -> float:
    """Roofline time of one matmul pass: compute or weight reads, whichever is slower."""
    return max(flops / flop_rate, nbytes / bandwidth)


def device_costs(inst: Instance) -> list[DeviceCosts]:
    return list(_device_costs(inst))


@lru_cache(maxsize=64)  # instances are frozen; Halda asks for the same costs many times
def _device_costs(inst: Instance) -> tuple[DeviceCosts, ...]:
    m = inst.model
    b = m.layer_bytes_max
    bp = b + m.kv_bytes_per_token_layer * inst.n_ctx
    out = []
    for d in inst.devices:
        ram = d.ram_available - (m.head_extra_bytes if d.is_head else 0)
        gpu_cap = 0
        gpu = math.inf
        if d.has_gpu:
            gpu = layer_time(m.layer_flops, b, d.gpu_flops, d.vram_bandwidth)
            gpu_cap = int(min(d.vram_free, max(ram, 0)) if d.unified_memory else d.vram_free) // bp
        out.append(DeviceCosts(
            name=d.name, is_head=d.is_head, routable=not d.is_head and d.name not in inst.must_stay,
            uma=d.unified_memory, macos=d.os == "macos", forced_fit=d.disk_seq_read < SLOW_DISK,
            alpha=layer_time(m.layer_flops, b, d.cpu_flops, d.ram_bandwidth), gpu=gpu,
            hop=d.link_latency_s + m.activation_bytes / d.link_bandwidth + d.frame_s, disk=d.disk_seq_read,
            b=b, b_prime=bp, ram=ram, ram_layers=ram // bp if ram >= 0 else -1, gpu_cap=gpu_cap,
            serial=m.serial_fraction * layer_time(m.layer_flops, b, d.cpu_flops, d.ram_bandwidth),
            copy=1.0 / d.ram_bandwidth))
    return tuple(out)


def kappa(inst: Instance) -> float:
    """Per-token constant: the head's output projection on its CPU (embedding lookup is one row)."""
    head, m = inst.devices[0], inst.model
    return layer_time(m.output_flops, m.output_weight_bytes, head.cpu_flops, head.ram_bandwidth)


def set_label(c: DeviceCosts, k: int, w: int, n: int) -> str:
    """prima.cpp's device sets: M4 fits; short devices are M1 (macOS CPU), M2 (Metal), M3 (others)."""
    if fits(c, k, w, n):
        return "M4"
    return "M2" if c.uma else ("M1" if c.macos else "M3")


def fits(c: DeviceCosts, k: int, w: int, n: int) -> bool:
    resident = k * w if c.uma else k * (w - n)
    return resident <= c.ram_layers


def window_ok(c: DeviceCosts, w: int, n: int) -> bool:
    """Whether the window may be this long: a node streams any window through its buffers, but a Metal
    Mac's mmap'd share must keep one window in memory or its prefetch evicts itself."""
    return window_fits(c, w, n) if c.uma else c.ram >= 0


def window_fits(c: DeviceCosts, w: int, n: int) -> bool:
    return (w if c.uma else w - n) <= c.ram_layers


def overflow_bytes(c: DeviceCosts, k: int, w: int, n: int) -> int:
    """Bytes of a non-Metal share its memory cannot keep (0 when it fits)."""
    return 0 if fits(c, k, w, n) or c.uma else k * (w - n) * c.b_prime - c.ram


def streams(c: DeviceCosts, k: int, w: int, n: int) -> bool:
    """Whether the device reads layers through a stream buffer (short, and not a Metal Mac)."""
    return not c.uma and not fits(c, k, w, n)


def disk_time(c: DeviceCosts, k: int, w: int, n: int, buffer: float) -> float:
    """Bytes read from disk per token / disk speed; buffer: the stream buffer's bytes."""
    if fits(c, k, w, n):
        return 0.0
    if c.uma:
        return k * w * c.b / c.disk  # macOS+Metal under pressure evicts the whole share (M2)
    return (overflow_bytes(c, k, w, n) + buffer) / c.disk


def inline_disk_time(c: DeviceCosts, k: int, w: int, n: int, buffer: float, prefetch: bool = True) -> float:
    """The part of disk_time read during the device's own turns, when its k gaps each fill the buffer
    (evaluate also caps what a gap hides by its length)."""
    d = disk_time(c, k, w, n, buffer)
    if not prefetch:
        return d
    if c.uma:
        return 0.0 if window_fits(c, w, n) else d
    return max(0.0, d - k * buffer / c.disk)


def stream_copy(c: DeviceCosts, k: int, w: int, n: int) -> float:
    """Compute time a streaming device loses per token to copying what it reads (its overflow and one
    layer) into its buffer: the reader's memmove shares the cores and memory with the compute."""
    return (overflow_bytes(c, k, w, n) + c.b) * c.copy if streams(c, k, w, n) else 0.0


def serial_compute(c: DeviceCosts, k: int) -> float:
    """A streaming device's compute per token that its turns' reads cannot overlap: in each round the
    attention stage of its first layer (its reads resume once that frees part of the full buffer) and the
    down projection of its last (computed after its read)."""
    return k * c.serial


def stream_turn(c: DeviceCosts, k: int, P: float, ovf: float, G: float) -> tuple[float, float, float] | None:
    """(turns, stream buffer bytes, bytes each gap hides) of a streaming device with compute P and overflow
    ovf bytes a token whose cycle may last G seconds (TPOT - kappa - its hops); None when it cannot fit.

    Each of its k gaps hides h bytes (its buffer B >= max(one layer, h) fills while the ring works), the
    turns read the rest beside the compute: z = max(P, (ovf + B - k h)/d + s), s = serial_compute. The cycle
    is z + k h/d = max(P + k h/d, (ovf + B)/d + s), so the most a gap may hide is
    h = min((G - P) d/k, (G - s) d - ovf), and buffer beyond the h at which the turn is compute bound only
    adds reads."""
    d, b, s = c.disk, c.b, serial_compute(c, k)
    h = min((G - P) * d / k, (G - s) * d - ovf)
    if h < 0 or (ovf + b) / d + s > G:
        return None
    # the least h past which hiding more gains nothing: reads (ovf + max(b, h) - k h)/d down to P - s (or 0)
    room = max(P - s, 0.0) * d
    if ovf + b - k * b <= room:
        enough = (ovf + b - room) / k
    else:  # past one layer each byte of h hides k - 1 net (none when k = 1)
        enough = b if k == 1 else (ovf - room) / (k - 1)
    h = min(h, max(enough, 0.0))
    buf = max(b, h)
    return max(P, max(0.0, ovf + buf - k * h) / d + s), buf, h


def best_buffers(P: list[float], ovf: list[float | None], hops: list[float], cs: list[DeviceCosts], k: int,
                 kap: float, base: float) -> tuple[float, list[float], list[float]]:
    """Least TPOT over the streaming devices' buffers, those buffers and the bytes each gap hides (0 where
    ovf is None).
    hops: each device's own hops per token; base: kappa + all hops + the turns of the devices that do
    not stream. Feasibility in T is monotone (every row loosens as T grows), so bisection finds it."""
    idx = [m for m, o in enumerate(ovf) if o is not None]

    def turns(T: float) -> list[tuple[float, float, float]] | None:
        out = []
        for m in idx:
            st = stream_turn(cs[m], k, P[m], ovf[m], T - kap - hops[m])
            if st is None:
                return None
            out.append(st)
        return out

    def ok(T: float) -> bool:
        z = turns(T)
        return z is not None and base + sum(t for t, _, _ in z) <= T

    lo, hi = base, base + 1.0
    while not ok(hi):  # every row holds once T is large enough
        lo, hi = hi, 2 * hi
    for _ in range(200):
        if hi - lo <= 1e-13 * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    bufs, hidden = [0.0] * len(P), [0.0] * len(P)
    for m, (_, buf, h) in zip(idx, turns(hi) or []):
        bufs[m], hidden[m] = buf, h
    return hi, bufs, hidden


def memory_bytes(c: DeviceCosts, k: int, w: int, n: int, extra: int) -> int:
    """Resident bytes (RAM + VRAM) the plan asks of the device, capped by what it has."""
    if c.uma:
        return min(k * w * c.b_prime, max(c.ram, 0)) + extra
    return min(k * (w - n) * c.b_prime, max(c.ram, 0)) + k * n * c.b_prime + extra


@dataclass(frozen=True)
class Breakdown:
    tpot_s: float
    compute_s: tuple[float, ...]  # P_m
    disk_s: tuple[float, ...]  # D_m
    hop_s: tuple[float, ...]  # k hop_m for ring members (when the ring has >= 2), else 0
    inline_s: tuple[float, ...]  # I_m: the reads in the device's own turns (beside its compute when prefetching)
    buffer_bytes: tuple[int, ...]  # B_m: the stream buffer of each streaming device (0: it does not stream)
    serial_s: tuple[float, ...]  # s_m: compute its turns' reads cannot overlap (streaming devices, else 0)
    labels: tuple[str, ...]
    ring_s: float  # kappa + the turns + hops
    kappa_s: float
    prefetch: bool = True

    @property
    def turn_s(self) -> tuple[float, ...]:
        """z_m: a device's turns per token, compute and the reads it cannot hide (side by side with prefetch)."""
        if self.prefetch:
            return tuple(max(p, i + s) for p, i, s in zip(self.compute_s, self.inline_s, self.serial_s))
        return tuple(p + i for p, i in zip(self.compute_s, self.inline_s))


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
    P, H, ovf, lab = [], [], [], []
    for c, wm, nm, r in zip(cs, w, n, in_ring):
        if wm and not r:
            raise ValueError(f"{c.name} holds layers but is not in the ring")
        if strict and (c.ram < 0 or not window_ok(c, wm, nm) or (c.forced_fit and not fits(c, k, wm, nm))):
            return None
        copy = stream_copy(c, k, wm, nm) if prefetch else 0.0  # on demand, the copy is inside the wait for a read
        P.append(k * (c.alpha * (wm - nm) + (c.gpu * nm if nm else 0.0)) + copy)
        H.append(k * c.hop if r and talks else 0.0)
        ovf.append(float(overflow_bytes(c, k, wm, nm)) if prefetch and streams(c, k, wm, nm) else None)
        lab.append(set_label(c, k, wm, nm) if r else "-")
    kap = kappa(inst)
    fixed = []  # turns of the devices best_buffers does not size a buffer for
    for m, c in enumerate(cs):
        if ovf[m] is not None:
            fixed.append(0.0)
        elif prefetch:  # fits, or a Metal Mac whose re-reads hide when one window fits
            fixed.append(max(P[m], inline_disk_time(c, k, w[m], n[m], 0.0)))
        else:  # loads on demand through a one-layer buffer, waiting for each read
            fixed.append(P[m] + disk_time(c, k, w[m], n[m], c.b))
    tpot, buf, hidden = best_buffers(P, ovf, H, cs, k, kap, kap + sum(H) + sum(fixed))
    if not prefetch:
        buf = [float(c.b) if streams(c, k, wm, nm) else 0.0 for c, wm, nm in zip(cs, w, n)]
    D = [disk_time(c, k, wm, nm, bm) for c, wm, nm, bm in zip(cs, w, n, buf)]
    inline = [max(0.0, d - k * h / c.disk) if o is not None else inline_disk_time(c, k, wm, nm, bm, prefetch)
              for c, wm, nm, bm, d, h, o in zip(cs, w, n, buf, D, hidden, ovf)]
    serial = [serial_compute(c, k) if o is not None else 0.0 for c, o in zip(cs, ovf)]
    turn = [max(p, i + s) if prefetch else p + i for p, i, s in zip(P, inline, serial)]
    ring = kap + sum(turn) + sum(H)
    metal = [kap + p + d for c, p, d in zip(cs, P, D) if c.uma and d > 0]  # its re-reads outlast the ring
    tpot = max([tpot, ring] + metal)
    return Breakdown(tpot, tuple(P), tuple(D), tuple(H), tuple(inline), tuple(int(round(b)) for b in buf),
                     tuple(serial), tuple(lab), ring, kap, prefetch)
