"""Event-by-event simulation of batches going round the ring: the oracle for solver/throughput.py's period.

A batch's decode step is a route of jobs: in each of k rounds every member (ranks 1.., then the head)
computes its window on its host's CPU and sends to its successor, and after the last round the head samples
(kappa). Every resource (a host's CPU, a link's send coroutine) serves one job at a time, first come first
served; G batches go round at once, each starting its next step as soon as it is back."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from solver.pipeline import MODES


@dataclass(frozen=True)
class Member:
    name: str
    host: str
    compute_s: dict[int, float]  # per round, by batch size
    hop_s: dict[int, float]  # per round, to its successor, by batch size


def route(members: list[Member], k: int, kappa_s: dict[int, float], b: int, mode: str
          ) -> list[tuple[str, float]]:
    """One step of a batch of b as (resource, seconds) jobs in order; members in token order, head last."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    jobs = []
    for r in range(k):
        for j, m in enumerate(members):
            succ = members[(j + 1) % len(members)]
            hop = 0.0 if mode == "free" and m.host != succ.host or len(members) == 1 else m.hop_s[b]
            cpu = f"cpu {m.host}"
            if mode == "blocking" or m.host == succ.host:  # loopback bytes (or a blocking send) hold the CPU
                jobs.append((cpu, m.compute_s[b] + (kappa_s[b] if r == k - 1 and j == len(members) - 1 else 0.0)
                             + hop))
            else:
                jobs.append((cpu, m.compute_s[b] + (kappa_s[b] if r == k - 1 and j == len(members) - 1 else 0.0)))
                jobs.append((f"link {m.name}", hop))
    merged: list[tuple[str, float]] = []  # a batch that moves on within a host keeps its CPU (loopback)
    for res, t in jobs:
        if t <= 0:
            continue
        if merged and merged[-1][0] == res:
            merged[-1] = (res, merged[-1][1] + t)
        else:
            merged.append((res, t))
    if len(merged) > 1 and merged[0][0] == merged[-1][0]:  # round the ring: the step's last job and the next
        merged[0] = (merged[0][0], merged[0][1] + merged.pop()[1])  # step's first are one visit too
    return merged


def simulate_ring(members: list[Member], k: int, kappa_s: dict[int, float], batches: list[int], mode: str,
                  steps: int = 60) -> float:
    """Steady-state period: seconds per step of every batch (the mean over the second half of `steps`)."""
    done_steps = ring_steps(members, k, kappa_s, batches, mode, steps)
    half = steps // 2
    return max((t[-1] - t[half]) / (len(t) - 1 - half) for t in done_steps)


def ring_steps(members: list[Member], k: int, kappa_s: dict[int, float], batches: list[int], mode: str,
               steps: int) -> list[list[float]]:
    """When each batch finished each of its steps; all start at t = 0 (the first wave is heteropipe's
    makespan of len(batches) micro-batches, pipeline.makespan, where no two visits share a resource)."""
    routes = [route(members, k, kappa_s, b, mode) for b in batches]
    queue: dict[str, deque] = {}
    busy: dict[str, bool] = {}
    events: list[tuple[float, int, int, int]] = []  # (time, seq, batch, job index it finished)
    seq = 0
    done_steps = [[] for _ in batches]

    def arrive(i: int, j: int, now: float) -> None:
        nonlocal seq
        if j == len(routes[i]):  # step done: the next one starts now
            done_steps[i].append(now)
            if len(done_steps[i]) >= steps:
                return
            j = 0
        res, _ = routes[i][j]
        queue.setdefault(res, deque()).append((i, j))
        start(res, now)

    def start(res: str, now: float) -> None:
        nonlocal seq
        if busy.get(res) or not queue[res]:
            return
        i, j = queue[res].popleft()
        busy[res] = True
        heapq.heappush(events, (now + routes[i][j][1], seq, i, j))
        seq += 1

    for i in range(len(batches)):
        arrive(i, 0, 0.0)
    while events:
        now, _, i, j = heapq.heappop(events)
        res = routes[i][j][0]
        busy[res] = False
        arrive(i, j + 1, now)
        start(res, now)
    return done_steps
