"""Cost model: per-device per-layer times and the TPOT of a (k, w, n) assignment on the piped ring."""

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

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from prima_rpc.spec.profiles import DeviceProfile
from solver.model_profile import ModelProfile

SLOW_DISK = 0.1e9  # B/s; below this prima.cpp forbids offloading (the device must fit, M4)
DEFAULT_CTX = 4096  # planning context length for the KV cache when none is given


@dataclass(frozen=True)
class Instance:
    devices: tuple[DeviceProfile, ...]  # ring order, head first
    model: ModelProfile
    n_ctx: int = 0  # tokens of KV cache to reserve per layer; 0 -> min(DEFAULT_CTX, max_seq_len)
    must_stay: frozenset[str] = field(default_factory=frozenset)  # devices the ring cannot route around
    batch: int = 1  # requests computed together per step (issue 16): the costs below are per batch of this many

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

    @cached_property  # the instance is frozen; Halda asks for its costs many times
    def costs(self) -> tuple[DeviceCosts, ...]:
        return _device_costs(self)


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
    copy: float = 0.0  # s the compute loses per byte read beside it (profile read_loss_s, else read_cpu_s, else a copy)
    shared_host: bool = False  # another device of the instance runs on its machine: its reads in its gaps slow theirs
    visit: float = 0.0  # s per window visit beyond its layers (profile visit_s): k a token when it holds layers
    cold: float = 0.0  # s more a layer's compute takes when it waited for its read (profile stream_layer_s)

    @property
    def beta(self) -> float:
        return self.gpu - self.alpha if self.gpu_cap else 0.0


def layer_time(flops: float, nbytes: float, flop_rate: float, bandwidth: float) -> float:
    """Roofline time of one matmul pass: compute or weight reads, whichever is slower."""
    return max(flops / flop_rate, nbytes / bandwidth)


def device_costs(inst: Instance) -> list[DeviceCosts]:
    return list(inst.costs)


def _device_costs(inst: Instance) -> tuple[DeviceCosts, ...]:
    m = inst.model
    b = m.layer_bytes_max
    bp = b + m.kv_bytes_per_token_layer * inst.n_ctx
    out = []
    hosts = [d.host for d in inst.devices]
    for d in inst.devices:
        f = d.batch_factor(inst.batch)  # a batch computes in one pass over the weights (1.0 for one request)
        cpu = d.read_cpu_s or 1.0 / d.ram_bandwidth  # CPU s a byte read costs; unmeasured: a copy at RAM speed
        copy = d.read_loss_s or cpu  # what the compute beside it loses per byte (measured: more than the CPU)
        ram = d.ram_available - (m.head_extra_bytes if d.is_head else 0)
        gpu_cap = 0
        gpu = math.inf
        if d.has_gpu:
            gpu = f * layer_time(m.layer_flops, b, d.gpu_flops, d.vram_bandwidth)
            gpu_cap = int(min(d.vram_free, max(ram, 0)) if d.unified_memory else d.vram_free) // bp
        out.append(DeviceCosts(
            name=d.name, is_head=d.is_head, routable=not d.is_head and d.name not in inst.must_stay,
            uma=d.unified_memory, macos=d.os == "macos", forced_fit=d.disk_seq_read < SLOW_DISK,
            alpha=f * layer_time(m.layer_flops, b, d.cpu_flops, d.ram_bandwidth), gpu=gpu,
            hop=d.link_latency_s + m.activation_bytes / d.link_bandwidth + d.frame_s,
            disk=min(d.disk_seq_read, 1.0 / cpu),  # the reader streams no faster than its CPU allows
            b=b, b_prime=bp, ram=ram, ram_layers=ram // bp if ram >= 0 else -1, gpu_cap=gpu_cap,
            serial=f * m.serial_fraction * layer_time(m.layer_flops, b, d.cpu_flops, d.ram_bandwidth),
            copy=copy, shared_host=hosts.count(d.host) > 1 if d.host else False,
            visit=d.visit_s, cold=d.stream_layer_s))
    if inst.batch > 1:  # a batch's frames follow each other on the stream: the latency once, every frame's bytes
        out = [replace(c, hop=c.hop + (inst.batch - 1) * (m.activation_bytes / d.link_bandwidth + d.frame_s))
               for c, d in zip(out, inst.devices)]  # and software cost (nodes send a batch as its frames)
    return tuple(out)


def kappa(inst: Instance) -> float:
    """Per-token constant: the head's output projection on its CPU (measured, output_s, or its roofline; the
    embedding lookup is one row) and its own work around it (token_s: hand-offs to its compute thread,
    sampling, detokenising, the token's event). For a batch: the output layer in one pass (its batch curve),
    the head's own work per request."""
    head, m = inst.devices[0], inst.model
    output = head.output_s or layer_time(m.output_flops, m.output_weight_bytes, head.cpu_flops, head.ram_bandwidth)
    return output * head.output_batch_factor(inst.batch) + inst.batch * head.token_s


# ------------------------------------------------------------------ one device's terms
# Everything a device costs per token is written here once: `device_terms` and `stream_turn` in numbers
# (evaluate, the exhaustive oracle, plan reports and the timeline read them), `device_rows` as the ILP's
# rows of the same terms (Halda). A new term is one edit in this section.


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
    return not c.forced_fit or fits(c, k, w, n)


@dataclass(frozen=True)
class Terms:
    """One device's terms per token for (k, w, n), before a streaming device's buffer is chosen."""
    label: str  # prima.cpp's set: M4 fits; short devices are M1 (macOS CPU), M2 (Metal), M3 (others)
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


def device_rows(model, c: DeviceCosts, k: int, W: int, m: int, w, n, hop_on, T, unit: float,
                may_offload: bool = True, member=None):
    """Halda's rows for device m (mip variables w, n; hop_on: 1 when it talks; T: the cycle bound, all in
    units of `unit` seconds): the terms of `device_terms` and `stream_turn` in linear form. Returns its turns
    per token (an expression or a variable). may_offload=False: only plans where its share fits are wanted
    (any other costs more than the caller's bound). member: a binary that w > 0 forces to 1 (it pays the
    window visits; None: one is made when visits cost). Equation numbers: prima.cpp's paper, as in halda.py."""
    import mip  # only Halda builds rows: the rest of the cost model needs no solver

    P = k / unit * (c.alpha * w + (c.beta * n if isinstance(n, mip.Var) else 0.0))
    if c.visit > 0:  # k visits a token when it holds layers (compute_time's w > 0)
        if member is None:
            member = model.add_var(f"holds({m})", var_type=mip.BINARY)
            model += w <= W * member, f"holds({m})"
        P = P + k * c.visit / unit * member
    cpu_w = w if c.uma else w - n  # layers per window held in RAM
    if c.uma:
        model += cpu_w <= c.ram_layers, f"window({m})"  # one window fits: its mmap prefetch can work
    if c.forced_fit or not may_offload:  # (31)-(33) M4 forced: disk too slow to offload to (or too slow to win)
        model += k * cpu_w <= c.ram_layers, f"eq31_fit({m})"
        return P
    y = model.add_var(f"y({m})", lb=0.0)  # disk seconds per token
    if c.uma:  # w = w4 + w2: M4 (z = 0, the share fits) or M2 (z = 1, (29): a = alpha + b/disk)
        z = model.add_var(f"z({m})", var_type=mip.BINARY)
        w4 = model.add_var(f"w4({m})", var_type=mip.INTEGER, lb=0, ub=c.ram_layers // k)
        w2 = model.add_var(f"w2({m})", var_type=mip.INTEGER, lb=0, ub=W)
        model += w == w4 + w2, f"uma_split({m})"
        model += w4 <= (c.ram_layers // k) * (1 - z), f"eq31_fit({m})"
        model += w2 <= W * z, f"m2_on({m})"
        model += w2 >= (c.ram_layers // k + 1) * z, f"m2_short({m})"  # short means over the fit
        model += y >= k * c.b / c.disk / unit * w2, f"eq29_m2({m})"  # the whole share re-read
        model += T >= P + y, f"eq6_prefetch({m})"  # Terms.cycle: its loads outlast the ring round
        return P
    # M1/M3 ((28)/(30): a = alpha + b'/disk, b = beta - b'/disk, minus what RAM keeps) or M4
    model += y >= (k * c.b_prime * (w - n) - c.ram) / c.disk / unit, f"eq30_m3({m})"
    o = model.add_var(f"o({m})", var_type=mip.BINARY)  # streams at all: it needs a stream buffer
    model += y <= k * W * c.b_prime / c.disk / unit * o, f"streams({m})"
    j = model.add_var(f"j({m})", var_type=mip.INTEGER, lb=0, ub=k * W)  # its stream buffer: whole layers
    model += j >= o, f"buffer({m})"  # at least one
    e = c.b / c.disk / unit * j  # its stream buffer's read time
    h = model.add_var(f"h({m})", lb=0.0)  # what one gap hides: at most the buffer
    model += h <= e, f"gap_fill({m})"
    v = model.add_var(f"v({m})", lb=0.0)  # reads in its own turns
    model += v >= y + e - k * h, f"inline({m})"
    zt = model.add_var(f"turn({m})", lb=0.0)  # its turns: compute and those reads side by side
    model += zt >= P + c.copy * c.disk * v, f"turn_compute({m})"  # the reader's CPU of its turns' bytes
    # ... but the streamed layers' compute (stream_turn): a per layer, (disk y + b j)/b layers; the layers it
    # waits for, disk v / b, start cold
    model += zt >= (v * (1 + c.cold * c.disk / c.b) + k * c.serial / unit * o + c.alpha * c.disk / c.b * y
                    + c.alpha / unit * j), f"turn_reads({m})"
    model += T >= zt + k * c.hop / unit * hop_on + k * h, f"cycle({m})"  # k gaps long enough
    # on a shared machine its gaps' bytes cost the device computing then their reader's CPU (stream_turn)
    return zt + c.copy * c.disk * k * h if c.shared_host else zt


# ------------------------------------------------------------------ a whole assignment


def offload_floor(c: DeviceCosts, k: int = 1) -> float:
    """Least cycle (TPOT - kappa) of the device in any k-round plan where it reads from disk: its first share
    that does not fit, computed (P_m), or read past its memory with one layer of buffer beside the compute its
    reads cannot overlap (D_m, s_m), and, off the head, its k hops (device_rows' cycle row). Grows with k."""
    if c.forced_fit or c.ram_layers < 0:
        return math.inf
    s = c.ram_layers + 1
    if c.uma:
        return s * (min(c.alpha, c.gpu) + c.b / c.disk)
    hops = 0.0 if c.is_head else k * c.hop  # the head's hop is paid only when it talks
    return max(s * c.alpha, (s * c.b_prime - c.ram + c.b) / c.disk + k * c.serial) + hops


def reads_floor(cs: list[DeviceCosts], k: int, L: int) -> float:
    """Least cycle (TPOT - kappa) of any k-round plan for L layers from its reads alone: what all memories
    (RAM, and VRAM off Metal) cannot hold, O = L b' - sum(memory), is read every token, device m reading
    o_m of it in a cycle of at least (o_m + b)/d_m + k s_m (+ k hops off the head; Metal re-reads its share,
    at least o_m b/b' bytes); the least t with sum_m of what m can read by t >= O (0 when all fits). Grows
    with k."""
    need = L * cs[0].b_prime - sum(max(c.ram, 0) + (0 if c.uma else c.gpu_cap * c.b_prime) for c in cs)
    if need <= 0:
        return 0.0
    readers = [(c.disk * c.b_prime / c.b, 0.0, 0.0) if c.uma else
               (c.disk, k * c.serial + (0.0 if c.is_head else k * c.hop), c.b)
               for c in cs if not c.forced_fit]  # (B/s, fixed s, buffer bytes)
    if not readers:
        return math.inf

    def readable(t: float) -> float:
        return sum(max(0.0, (t - fixed) * d - buf) for d, fixed, buf in readers)

    lo, hi = 0.0, 1.0
    while readable(hi) < need:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if readable(mid) < need else (lo, mid)
    return lo


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


def memory_bytes(c: DeviceCosts, k: int, w: int, n: int, extra: int) -> int:
    """Resident bytes (RAM + VRAM) the plan asks of the device, capped by what it has."""
    if c.uma:
        return min(k * w * c.b_prime, max(c.ram, 0)) + extra
    return min(k * (w - n) * c.b_prime, max(c.ram, 0)) + k * n * c.b_prime + extra


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
