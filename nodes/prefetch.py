"""Disk offload: which layers stay resident under a memory budget, and a prefetcher that streams the rest.

A token visits a node's layers in one fixed cyclic order (its windows in layer order, round after round,
then the next token from the first again). The layers that do not fit stay on disk and go through
`slots` preallocated layer buffers: while one computes, a reader thread loads the next streamed layers in
that order into the free buffers. A buffer is free only once its layer was used (or, after a
misprediction, is no longer expected), so nothing prefetched is evicted before its use: the
prefetch-release conflict cannot happen. Decisions are pure functions (tested with tables); `Prefetcher`
performs them.
"""

import os
import threading
import time
from dataclasses import dataclass
from enum import Enum

import psutil
import torch

from nodes.config import ModelConfig, StoreError
from nodes.fused import empty_layer, layer_targets
from nodes.model import Layer
from nodes.store import LayerStore

DEPTH = 1  # streamed layers read ahead of the one computing (slots = DEPTH + 1): double buffering
KV_RESERVE_TOKENS = 2048  # KV positions the budget keeps room for, all requests together (more are refused)
DEFAULT_FRACTION = 0.8  # default budget: this share of the RAM available at assignment
DEPTH_ENV = "PRIMA_PREFETCH_DEPTH"  # benchmarks: 0 = no prefetch (load on demand)


def default_budget() -> int:
    return int(psutil.virtual_memory().available * DEFAULT_FRACTION)


def prefetch_depth() -> int:
    """The read-ahead depth: DEPTH, or the environment's PRIMA_PREFETCH_DEPTH (0 turns prefetch off)."""
    text = os.environ.get(DEPTH_ENV, "")
    try:
        depth = int(text) if text else DEPTH
    except ValueError:
        raise StoreError(f"{DEPTH_ENV}={text!r} is not a whole number") from None
    if depth < 0:
        raise StoreError(f"{DEPTH_ENV} must be >= 0, got {depth}")
    return depth


@dataclass(frozen=True)
class Plan:
    """How a node holds its layers under a budget."""

    order: tuple[int, ...]  # the node's layers in visit order
    resident: frozenset[int]
    streamed: tuple[int, ...]  # in visit order
    slots: int  # layer buffers the streamed layers go through (0: nothing streamed)
    prefetch: bool  # read ahead (else load on demand)
    budget: int  # effective budget in bytes: the requested one, or the minimum when that was lower
    requested: int  # 0: unlimited
    layer_bytes: int
    fixed_bytes: int  # head units + KV reserve, always in memory

    @property
    def weight_bytes(self) -> int:
        """Layer memory: resident layers plus the slots."""
        return (len(self.resident) + self.slots) * self.layer_bytes

    @property
    def below_minimum(self) -> bool:
        return 0 < self.requested < self.budget


def spread(n: int, k: int) -> list[int]:
    """k of the positions 0..n-1, evenly spaced (k <= n)."""
    assert 0 <= k <= n, (n, k)
    return [(2 * j + 1) * n // (2 * k) for j in range(k)]


def plan_memory(order: list[int], layer_bytes: int, fixed_bytes: int, budget: int, depth: int) -> Plan:
    """Resident layers and streaming slots for `budget` bytes (0: unlimited).

    Everything that fits stays resident. Otherwise `depth + 1` slots (fewer if the budget allows fewer,
    at least one) and as many resident layers as the rest of the budget holds; streamed layers are spread
    evenly through the visit order, so resident compute between them gives the reader time. A budget
    below head + KV reserve + one slot runs at that minimum.
    """
    n = len(order)
    plan = dict(order=tuple(order), prefetch=depth > 0, requested=budget, layer_bytes=layer_bytes,
                fixed_bytes=fixed_bytes)
    if budget <= 0 or n == 0 or fixed_bytes + n * layer_bytes <= budget:
        return Plan(resident=frozenset(order), streamed=(), slots=0,
                    budget=budget if budget > 0 else 0, **plan)
    room = max(0, (budget - fixed_bytes) // layer_bytes)  # layers the budget holds
    slots = max(1, min(depth + 1, room))
    resident_count = max(0, room - slots)
    streamed_at = set(spread(n, n - resident_count))
    streamed = tuple(layer for pos, layer in enumerate(order) if pos in streamed_at)
    resident = frozenset(order) - set(streamed)
    used = fixed_bytes + (len(resident) + slots) * layer_bytes
    return Plan(resident=resident, streamed=streamed, slots=slots, budget=max(budget, used), **plan)


def wanted(streamed: tuple[int, ...], cursor: int, slots: int, prefetch: bool, in_use: int | None) -> tuple[int, ...]:
    """The streamed layers that should be in memory now, nearest use first.

    cursor: index in `streamed` of the next expected layer (the one in use, while one is)."""
    if not prefetch:
        return (in_use,) if in_use is not None else ()
    return tuple(streamed[(cursor + j) % len(streamed)] for j in range(min(slots, len(streamed))))


class SlotState(Enum):
    EMPTY = "empty"
    LOADING = "loading"
    READY = "ready"


@dataclass(frozen=True)
class Held:
    state: SlotState = SlotState.EMPTY
    layer: int | None = None


def next_load(want: tuple[int, ...], held: list[Held], failed: set[int], in_use: int | None) -> tuple[int, int] | None:
    """(layer, slot) to read next, or None to wait: the nearest wanted layer not in memory, into an empty
    slot or one whose layer is neither wanted nor in use (never one prefetched and still expected)."""
    for layer in want:
        if layer in failed or any(h.layer == layer for h in held):
            continue
        free = [i for i, h in enumerate(held) if h.state is SlotState.EMPTY]
        free = free or [i for i, h in enumerate(held)
                        if h.state is SlotState.READY and h.layer not in want and h.layer != in_use]
        return (layer, free[0]) if free else None
    return None


class Prefetcher:
    """Streams the plan's streamed layers through its slots; acquire/release come from the compute thread."""

    def __init__(self, store: LayerStore, plan: Plan, cfg: ModelConfig, dtype: torch.dtype):
        assert plan.streamed and plan.slots >= 1, plan
        self.store, self.plan = store, plan
        self.streamed = plan.streamed
        self.index = {layer: i for i, layer in enumerate(plan.streamed)}
        self.buffers = [empty_layer(cfg, dtype) for _ in range(plan.slots)]
        self.targets = [layer_targets(b, cfg) for b in self.buffers]
        self.held = [Held() for _ in self.buffers]
        self.cursor, self.in_use = 0, None
        self.errors: dict[int, Exception] = {}
        self.stall_s, self.loads, self.misses = 0.0, 0, 0
        self.closed = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="prefetch", daemon=True)

    def start(self) -> None:
        """Start reading ahead (the buffers may be used for other reads until then)."""
        self.thread.start()

    def _want(self) -> tuple[int, ...]:
        return wanted(self.streamed, self.cursor, self.plan.slots, self.plan.prefetch, self.in_use)

    def _ready(self, layer: int) -> int | None:
        return next((i for i, h in enumerate(self.held) if h.layer == layer and h.state is SlotState.READY), None)

    def acquire(self, layer: int) -> Layer:
        """The streamed layer's weights, waiting for its read if needed (the wait counts as stall)."""
        with self.cond:
            if self.plan.prefetch and layer not in self._want():
                self.misses += 1  # not the predicted order (e.g. interleaved requests): re-aim from here
            self.cursor, self.in_use = self.index[layer], layer
            self.cond.notify_all()
            slot = self._ready(layer)
            if slot is None:
                start = time.perf_counter()
                while (slot := self._ready(layer)) is None:
                    if layer in self.errors:
                        self.in_use = None
                        raise self.errors.pop(layer)
                    self.cond.wait()
                self.stall_s += time.perf_counter() - start
            return self.buffers[slot]

    def release(self, layer: int) -> None:
        """The layer's compute is done: its slot may take the next layer."""
        with self.cond:
            self.in_use = None
            self.cursor = (self.index[layer] + 1) % len(self.streamed)
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (job := next_load(self._want(), self.held, set(self.errors),
                                                            self.in_use)) is None:
                    self.cond.wait()
                if self.closed:
                    return
                layer, slot = job
                self.held[slot] = Held(SlotState.LOADING, layer)
            error = None
            try:
                self.store.read_into(f"layer.{layer}", self.targets[slot])
            except Exception as exc:  # any failure must reach the waiting compute thread
                error = exc if isinstance(exc, StoreError) else StoreError(f"layer {layer}: {exc!r}")
            with self.cond:
                self.held[slot] = Held(SlotState.READY, layer) if error is None else Held()
                if error is not None:
                    self.errors[layer] = error
                self.loads += 1
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
