"""Cost model: per-device per-layer times and the TPOT of a (k, w, n) assignment on the piped ring."""

# One token goes round the ring k times; in each round device m computes w_m layers, n_m of them
# on its GPU. Per token, with s_m = k w_m layers on m (its share):
#
#     P_m = k (alpha_m (w_m - n_m) + g_m n_m)          compute (decode is memory bound)
#     D_m = streamed bytes / disk_m                     disk loads when the share exceeds memory
#     I_m = max(0, D_m - k SLOTS t_m)                   the loads prefetch cannot hide (t_m: one layer)
#     TPOT = kappa + max(sum_m P_m + k sum_ring hop_m + sum_m I_m,  max_m (P_m + D_m))
#
# This is what a node does (nodes/prefetch.py): a short device keeps what its memory holds but
# SLOTS layers resident and streams the rest, overflow + SLOTS layers a token, through SLOTS
# buffers. While the rest of the ring works it can fill only those buffers, so each of its k
# gaps hides at most SLOTS reads; the others are read during its own turn and lengthen the
# ring's round (I_m). With k = 1 that is the whole overflow (prima.cpp's additive model); with
# more rounds more of it hides, until the device's own compute + loads (P_m + D_m) is the bound:
# that is why PRP exists. The gap length itself is not modelled (it holds while the others' turns
# outlast SLOTS reads; measured in tools/bench/bench_prediction.py). A Metal device (uma) under
# pressure re-reads its whole share (prima.cpp's M2), hidden when one window fits.

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from solver.model_profile import ModelProfile
from solver.profiles import DeviceProfile

SLOTS = 2  # a node's streaming buffers: nodes.prefetch.DEPTH + 1 (without prefetch: 1, nothing hidden)
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
            b=b, b_prime=bp, ram=ram, ram_layers=ram // bp if ram >= 0 else -1, gpu_cap=gpu_cap))
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


def disk_time(c: DeviceCosts, k: int, w: int, n: int, prefetch: bool = True) -> float:
    """Bytes read from disk per token / disk speed (without prefetch a node streams through one buffer)."""
    if fits(c, k, w, n):
        return 0.0
    if c.uma:
        return k * w * c.b / c.disk  # macOS+Metal under pressure evicts the whole share (M2)
    slots = SLOTS if prefetch else 1
    return (k * (w - n) * c.b_prime - c.ram) / c.disk + slots * c.b / c.disk  # overflow, and the buffers'


def inline_disk_time(c: DeviceCosts, k: int, w: int, n: int, prefetch: bool = True) -> float:
    """The part of disk_time read during the device's own turns, on the ring's critical path."""
    d = disk_time(c, k, w, n, prefetch)
    if not prefetch:
        return d
    if c.uma:
        return 0.0 if window_fits(c, w, n) else d
    return max(0.0, d - k * SLOTS * c.b / c.disk)


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
    inline_s: tuple[float, ...]  # I_m: the loads read in the device's own turns, on the ring's critical path
    labels: tuple[str, ...]
    ring_s: float  # kappa + sum P + hops + inline loads
    kappa_s: float


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
    """TPOT of an assignment. strict: return None where Halda's rows forbid it
    (window does not fit, slow disk overflows, head cannot hold its embedding/output)."""
    check_assignment(inst, k, w, n)
    cs = device_costs(inst)
    if in_ring is None:
        in_ring = [wm > 0 or not c.routable for c, wm in zip(cs, w)]
    talks = sum(in_ring) >= 2  # a ring of one device sends nothing over the network
    P, D, H, inline, lab = [], [], [], [], []
    for c, wm, nm, r in zip(cs, w, n, in_ring):
        if wm and not r:
            raise ValueError(f"{c.name} holds layers but is not in the ring")
        if strict and (c.ram < 0 or not window_ok(c, wm, nm) or (c.forced_fit and not fits(c, k, wm, nm))):
            return None
        P.append(k * (c.alpha * (wm - nm) + (c.gpu * nm if nm else 0.0)))
        D.append(disk_time(c, k, wm, nm, prefetch))
        inline.append(inline_disk_time(c, k, wm, nm, prefetch))
        H.append(k * c.hop if r and talks else 0.0)
        lab.append(set_label(c, k, wm, nm) if r else "-")
    kap = kappa(inst)
    ring = kap + sum(P) + sum(H) + sum(inline)
    tpot = max([ring] + [kap + p + d for p, d in zip(P, D) if d > 0])
    return Breakdown(tpot, tuple(P), tuple(D), tuple(H), tuple(inline), tuple(lab), ring, kap)
