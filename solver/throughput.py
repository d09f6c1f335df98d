"""Throughput of a plan for M concurrent requests: batches round the ring, heteropipe's makespans (issue 16).

A node computes the frames of different requests waiting for the same layers as one batch (one pass over the
weights, one disk read of a streamed layer; attention per request), at a cost that grows slowly with the
batch (DeviceProfile.batch_factor). The head sends the M requests' decode steps round the ring as batches of
at most `max_batch` requests, at most `micro_batches` of them in flight: a batch that comes back is sampled
and goes round again while the others are in the ring. Every request gets one token per *period*: its
per-request TPOT; the ring makes M / period tokens a second.

The period, from heteropipe (solver/pipeline.py). One batch of b alone takes R(b), the makespan of a single
micro-batch, T(1) = sum tau + sum d: the plan's TPOT at batch b (cost_model.evaluate, so M = 1 gives today's
prediction exactly). Each further micro-batch in a wave adds tau_max, the busiest stage (T(M) = T(1) + (M-1)
tau_max). In steady state the batches do not wait for each other (a wave's fill overlaps the previous one),
so with batches b_1..b_G in flight

    period = max(max_i R(b_i), max over resources r of sum_i busy_r(b_i))

the round trip when the ring is not full, else the busiest resource's work for all batches (heteropipe's
(M-1) tau_max term per wave). Resources and their busy time per batch, by mode:
  - a host's CPU: the compute of every device on it (compute beside its disk reads, the head's output layer
    and per-request work); one device per host in a home cluster, all of them on a loopback ring
  - a link (a node's send coroutine, one frame after another): its k hops
  - a streaming device's disk: its reads (one read of a streamed layer serves a whole batch); a device waiting
    for its disk leaves the CPU to others (its reads in its own turns are in R, not in the CPU's work)
  - "async" (what the ring does: a node sends on its own send coroutine, so its next compute overlaps its
    sends; heteropipe's Theorem 2): links are resources of their own; "blocking": a send holds its sender
    (sigma = tau + d, Theorem 3); "free": sends cost nothing (Theorem 1). A link between two devices of one
    host is loopback: moving its bytes is that host's CPU's work, so it is charged there in every mode.
solver/ring_sim.py simulates the same ring event by event; tests compare the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from solver.cost_model import Breakdown, Instance, evaluate
from solver.pipeline import MODES
from solver.plan import RingPlan

MAX_MICRO_BATCHES = 8  # the most batches in flight a plan considers (the ring has at most this many busy stages
# in a home)
NEAR = 0.01  # batchings this close to the best period count as equal (the fewest batches in flight wins)


@dataclass(frozen=True)
class Throughput:
    concurrency: int  # M requests decoding at once
    aggregate_tps: float  # tokens/s of all of them together
    tpot_s: float  # per request: seconds between its tokens (the period)
    mode: str  # free | async | blocking
    bottleneck: str  # the busiest resource: "device X", "link X -> Y", "shared host CPU (X, Y)"
    max_batch: int
    micro_batches: int
    batches: tuple[int, ...]  # batch sizes in flight
    round_trip_s: float  # the largest batch's R(b): the period when the ring is not full
    busiest_s: float  # the busiest resource's work per period: the period when it is
    latency_bound: bool  # round trip >= the busiest resource: more micro-batches would overlap it


def batch_sizes(concurrency: int, max_batch: int, micro_batches: int) -> tuple[int, ...]:
    """Batches in flight: requests fill batches of max_batch in turn, at most micro_batches of them (any
    request beyond waits for a batch to come back, so it joins the batch that comes back)."""
    for name, v in (("concurrency", concurrency), ("max_batch", max_batch), ("micro_batches", micro_batches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    n = min(micro_batches, math.ceil(concurrency / max_batch))
    # More requests than n * max_batch: the head's waiting queue refills each batch that returns, so the
    # period is that of n full batches serving ceil(M / (n max_batch)) turns each.
    full, rest = divmod(min(concurrency, n * max_batch), max_batch)
    return (max_batch,) * full + ((rest,) if rest else ())


def resources(inst: Instance, br: Breakdown, in_ring: list[bool], mode: str) -> tuple[dict[str, float], float]:
    """(busy seconds per batch of each resource (see the module's doc), seconds of its hops that cross a wire)
    for the breakdown at that batch."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    devs = inst.devices
    members = [i for i in list(range(1, len(devs))) + [0] if in_ring[i]]  # token order: ranks 1.., the head
    nxt = {m: members[(j + 1) % len(members)] for j, m in enumerate(members)}
    host = {i: d.host or f"\0{d.name}" for i, d in enumerate(devs)}  # no host given: a machine of its own
    on_host: dict[str, list[int]] = {}
    for m in members:
        on_host.setdefault(host[m], []).append(m)
    # A device's compute and its reader's CPU, the head's constant; its disk apart.
    cpu = {h: sum(br.compute_s[m] + br.read_cpu_s[m] + (br.kappa_s if m == 0 else 0.0) for m in ms)
           for h, ms in on_host.items()}
    disks = {f"disk of {devs[m].name}": br.disk_s[m] for m in members if br.disk_s[m] > 0}
    links: dict[str, float] = {}
    wire = 0.0
    for m in members:
        hop = br.hop_s[m]
        if not hop:
            continue
        wire += hop if host[m] != host[nxt[m]] else 0.0
        if host[m] == host[nxt[m]] or mode == "blocking":
            cpu[host[m]] += hop  # loopback bytes are moved by the host's cores; a blocking send holds them
        elif mode == "async":  # free: a wire costs nothing
            links[f"link {devs[m].name} -> {devs[nxt[m]].name}"] = hop
    out = {}
    for h, ms in on_host.items():
        names = [devs[m].name for m in ms]
        out[f"shared host CPU ({', '.join(names)})" if len(ms) > 1 else f"device {names[0]}"] = cpu[h]
    return out | links | disks, wire


def period(round_trips: list[float], busy: list[dict[str, float]]) -> tuple[float, str, float]:
    """(period, busiest resource, its work per period) of batches with these round trips and busy times."""
    total: dict[str, float] = {}
    for per in busy:
        for r, t in per.items():
            total[r] = total.get(r, 0.0) + t
    top = max(total, key=total.get)
    return max(max(round_trips), total[top]), top, total[top]


def predict_throughput(plan: RingPlan, inst: Instance, concurrency: int, max_batch: int | None = None,
                       micro_batches: int | None = None, mode: str = "async", prefetch: bool = True) -> Throughput:
    """Aggregate tokens/s and per-request TPOT of `plan` for `concurrency` requests with this batching (None: the
    best of `candidates` for it, the fewest batches in flight among those within NEAR of the best period)."""
    if [d.name for d in plan.devices] != [d.name for d in inst.devices]:
        raise ValueError("the plan's devices do not match the profiles (names / ring order)")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if max_batch is None or micro_batches is None:
        options = [predict_throughput(plan, inst, concurrency, b, g, mode, prefetch)
                   for b, g in candidates(concurrency, max_batch, micro_batches)]
        best = min(t.tpot_s for t in options)
        # Within NEAR of the best, the fewest batches in flight: each costs the ring its own pass over the weights
        # (its own disk reads), its buffers and frames, which the model prices only where they are the bottleneck
        return min((t for t in options if t.tpot_s <= best * (1 + NEAR)), key=lambda t: (t.micro_batches, t.tpot_s))
    sizes = batch_sizes(concurrency, max_batch, micro_batches)
    trips, busy = [], []
    for b in sorted(set(sizes)):
        br = evaluate(replace(inst, batch=b), plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring,
                      prefetch=prefetch)
        per, wire = resources(inst, br, plan.in_ring, mode)
        trip = br.tpot_s - (wire if mode == "free" else 0.0)
        trips += [trip] * sizes.count(b)
        busy += [per] * sizes.count(b)
    p, top, work = period(trips, busy)
    served = sum(sizes)  # requests beyond these wait their turn: each gets a token every turns * period
    turns = math.ceil(concurrency / served)
    return Throughput(concurrency, concurrency / (turns * p), turns * p, mode, top, max_batch, micro_batches,
                      sizes, max(trips), work, max(trips) >= work)


def candidates(concurrency: int, max_batch: int | None = None, micro_batches: int | None = None
               ) -> list[tuple[int, int]]:
    """(max_batch, micro_batches) worth trying for M requests: G batches in flight of ceil(M / G) each (equal
    batches: an unequal one would hold the others back), G up to MAX_MICRO_BATCHES; a given value is kept."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    if max_batch is not None and micro_batches is None:
        return [(max_batch, g) for g in range(1, min(MAX_MICRO_BATCHES, math.ceil(concurrency / max_batch)) + 1)]
    if micro_batches is not None:
        return [(math.ceil(concurrency / micro_batches), micro_batches)]
    out = []
    for g in range(1, min(MAX_MICRO_BATCHES, concurrency) + 1):
        b = math.ceil(concurrency / g)
        if (b, math.ceil(concurrency / b)) not in out:
            out.append((b, math.ceil(concurrency / b)))
    return out
