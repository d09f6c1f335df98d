"""Brute-force discrete-event simulation of a pipeline, the oracle for pipeline.py's closed forms."""

from __future__ import annotations

import heapq
from collections import deque

from solver.pipeline import MODES, _check, _check_m


def simulate_pipeline(tau: list[float], d: list[float] | None, M: int, mode: str) -> float:
    """All M micro-batches wait at stage 0 at t=0; each stage serves FIFO, one at a time.
    async: a send is a pure delay. blocking: the sender stays busy until its send lands
    (the delivery hop d[-1] never blocks). free: sends take no time. Returns the last arrival."""
    t, dd = _check(tau, d)
    _check_m(M)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "free":
        dd = [0.0] * len(t)
    S = len(t)
    queue = [deque() for _ in range(S)]
    queue[0].extend(range(M))
    busy = [False] * S
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, kind, stage, batch)
    seq = 0
    last = 0.0

    def push(time: float, kind: str, stage: int, batch: int) -> None:
        nonlocal seq
        heapq.heappush(events, (time, seq, kind, stage, batch))
        seq += 1

    def start(stage: int, now: float) -> None:
        if not busy[stage] and queue[stage]:
            busy[stage] = True
            push(now + t[stage], "done", stage, queue[stage].popleft())

    start(0, 0.0)
    while events:
        now, _, kind, s, i = heapq.heappop(events)
        if kind == "arrive":
            queue[s].append(i)
            start(s, now)
        elif kind == "free":
            busy[s] = False
            start(s, now)
        else:  # done computing batch i on stage s
            if s == S - 1:
                last = max(last, now + dd[s])  # delivery hop, never blocks
                push(now, "free", s, i)
            else:
                push(now + dd[s], "arrive", s + 1, i)
                push(now + dd[s] if mode == "blocking" else now, "free", s, i)
    return last
