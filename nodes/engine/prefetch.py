"""Disk offload: the prefetcher that streams what the memory plan (nodes/engine/memory_plan.py) does not keep.

A token visits a node's layers in one fixed cyclic order (its windows in layer order, round after round,
then the next token from the first again). A layer's four matrices (wqkv, wo, w_gate_up, w_down) are the
units of residency: what the budget holds beside a stream buffer stays resident, down to single units of
one layer, so no memory is left over; the rest streams, in visit order, through the buffer (a ring of
bytes, at least one layer): while the node computes, and while the rest of the ring works, a reader thread
fills whatever of the buffer is free with the next streamed units. Space is freed only when its layer was
used (or, after a misprediction, is no longer expected), so nothing read ahead is evicted before its use.

How big the buffer is, is the plan's choice (solver.cost_model): each byte of it is read once more a
token, but lets one more byte be read while the rest of the ring works. Streamed layers are placed where
they cost least: the first few of each window at its start (read during the gap before it, and used at
once, so the buffer frees for the next reads) and the others at its end, so their reads run beside the
compute of the window's resident layers. Decisions are pure functions (tested with tables: the plan's in
memory_plan.py, the buffer's arena here); `Prefetcher` performs them.
"""

import atexit
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

import psutil
import torch

from nodes.engine.formats import Format
from nodes.engine.fused import STREAM_UNITS, part_targets, part_weight, stream_parts
from nodes.engine.memory_plan import DEPTH, MemoryPlan, aligned
from nodes.engine.memory_room import capped
from nodes.engine.store import LayerStore
from prima_rpc.spec.manifest import ModelConfig, StoreError

KV_RESERVE_TOKENS = 2048  # KV positions an explicit --mem-budget keeps room for, all requests together
DEFAULT_FRACTION = 0.8  # default budget: this share of the RAM available at assignment
DEPTH_ENV = "PRIMA_PREFETCH_DEPTH"  # benchmarks: 0 = no prefetch (load on demand)
MAX_BUFFER_LAYERS = 1024  # a plan's stream buffer beyond this is not a plan (Assign refuses it)


def default_budget() -> int:
    return int(capped(psutil.virtual_memory().available) * DEFAULT_FRACTION)


def kv_reserve_tokens(cfg: ModelConfig, default_budget: bool) -> int:
    """KV positions a budget keeps room for beside the weights: the default one, a request at the model's whole
    context; one given (--mem-budget, often tight on purpose), KV_RESERVE_TOKENS at most."""
    return cfg.max_seq_len if default_budget else min(KV_RESERVE_TOKENS, cfg.max_seq_len)


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


_RUNNING: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()


@atexit.register
def _close_running() -> None:
    """Stop every reader thread before the interpreter finalizes: a daemon thread still inside torch then (a copy
    into the buffer, the GIL released) is ended by pthread_exit when it asks for the GIL back, unwinding torch's C++
    frames, and the process aborts ("terminate called without an active exception", SIGABRT) after its work is
    done: 1 exit in 20 on SmolLM2 fp32, streamed (tests/test_prefetch_exit.py)."""
    for prefetcher in list(_RUNNING):
        prefetcher.close()


def arena_alloc(size: int, used: list[tuple[int, int]], n: int) -> int | None:
    """Where n bytes go in a ring buffer of `size` bytes whose allocations `used` ((offset, bytes), oldest
    first) are freed oldest first; None when they do not fit until more is freed."""
    if not used:
        return 0 if n <= size else None
    oldest, (last, last_n) = used[0][0], used[-1]
    end = last + last_n
    if last >= oldest:  # not wrapped: after the newest, else from the start up to the oldest
        if end + n <= size:
            return end
        return 0 if n <= oldest else None
    return end if end + n <= oldest else None


def fits_alone(size: int, offset: int, sizes: list[int]) -> bool:
    """Whether a layer's units (`sizes`, in order) placed from `offset` on, wrapping to the start at most
    once, fit a ring buffer of `size` bytes with nothing else in it: when a layer is awaited, everything
    older has been freed, so its units must fit then or the wait would never end."""
    pos, wrapped = offset, False
    for i, n in enumerate(sizes):
        if pos + n <= (offset if wrapped else size):
            pos += n
        elif not wrapped and i and n <= offset:
            pos, wrapped = n, True
        else:
            return False
    return True


@dataclass
class Piece:
    """One streamed unit of one layer, in the buffer."""

    index: int  # in the plan's cyclic list of pieces
    offset: int
    size: int
    ready: bool = False
    error: Exception | None = None


class Prefetcher:
    """Streams the plan's streamed units through its buffer; acquire/release come from the compute thread."""

    def __init__(self, store: LayerStore, plan: MemoryPlan, cfg: ModelConfig, dtype: torch.dtype,
                 fmt: Format | None = None):
        """fmt: the store's quantized format (None: float matrices)."""
        assert plan.streamed and plan.buffer > 0, plan
        self.store, self.plan, self.cfg, self.dtype = store, plan, cfg, dtype
        self.fmt = {layer: fmt and fmt.layer(layer) for layer, _ in plan.streamed}  # each layer's own formats
        self.parts = {layer: {u: stream_parts(u, cfg, f, dtype) for u in STREAM_UNITS} for layer, f in self.fmt.items()}
        self.pieces = [(layer, unit) for layer, units in plan.streamed for unit in units]  # cyclic order
        self.first = {}  # layer -> index of its first piece
        for i, (layer, _) in enumerate(self.pieces):
            self.first.setdefault(layer, i)
        self.count = {layer: len(units) for layer, units in plan.streamed}
        self.units = dict(plan.streamed)
        self.buffer = torch.empty(plan.buffer, dtype=torch.uint8)
        self.queue: deque[Piece] = deque()  # in the buffer, oldest first
        self.cursor = 0  # the next piece to read when the queue is empty
        self.in_use: int | None = None
        self.stall_s, self.loads, self.misses = 0.0, 0, 0
        self.closed = self.flushing = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="prefetch", daemon=True)

    def start(self) -> None:
        """Start reading ahead (the buffer may be used for other reads until then)."""
        _RUNNING.add(self)
        self.thread.start()

    def view(self, layer: int, unit: str, offset: int) -> dict[str, torch.Tensor]:
        """The layer's unit's tensors (nodes.engine.fused.stream_parts) in the buffer from `offset`, each 64-byte
        aligned."""
        out = {}
        for name, (dt, shape) in self.parts[layer][unit].items():
            n = torch.Size(shape).numel() * dt.itemsize
            out[name] = self.buffer[offset:offset + n].view(dt).view(shape)
            offset += aligned(n)
        return out

    def scratch(self, layer: int) -> dict[str, dict[str, torch.Tensor]]:
        """Every matrix of streamed `layer`, laid out in the buffer (for reads before the prefetcher starts)."""
        out, offset = {}, 0
        for unit in STREAM_UNITS:
            out[unit] = self.view(layer, unit, offset)
            offset += self.plan.unit_bytes[layer][unit]
        return out

    def _next_job(self) -> tuple[int, int] | None:
        """(piece index, offset) to read next, or None to wait."""
        if self.flushing or len(self.queue) >= len(self.pieces):
            return None  # dropping what was read ahead, or one whole cycle is in the buffer
        index = (self.queue[-1].index + 1) % len(self.pieces) if self.queue else self.cursor
        layer, unit = self.pieces[index]
        if not self.plan.prefetch and layer != self.in_use:
            return None  # on demand: only the layer being waited for
        used = [(p.offset, p.size) for p in self.queue]
        offset = arena_alloc(self.plan.buffer, used, self.plan.unit_bytes[layer][unit])
        if offset is not None and index == self.first[layer]:
            sizes = [self.plan.unit_bytes[layer][u] for u in self.units[layer]]
            if not fits_alone(self.plan.buffer, offset, sizes):  # start it at 0 (wasting the end), or wait
                offset = 0 if not used or (used[-1][0] >= used[0][0] and sizes[0] <= used[0][0]) else None
        return None if offset is None else (index, offset)

    def acquire(self, layer: int, units: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Some of the layer's streamed matrices (the next ones of its units, in order) from the buffer,
        waiting for their reads if needed (the wait counts as stall)."""
        first = self.first[layer] + self.units[layer].index(units[0])
        with self.cond:
            if self.queue and self.queue[0].index != first:
                self.misses += 1  # not the predicted order (e.g. interleaved requests): re-aim from here
                self._flush()
            if not self.queue:
                self.cursor = first
            self.in_use = layer
            self.cond.notify_all()
            start = time.perf_counter()
            waited = False
            while True:
                got = list(self.queue)[:len(units)]
                failed = next((p.error for p in got if p.error is not None), None)
                if failed is not None or (len(got) == len(units) and all(p.ready for p in got)):
                    break
                waited = True
                self.cond.wait()
            if waited:
                self.stall_s += time.perf_counter() - start
            if failed is not None:
                self._flush()
                self.in_use = None
                raise failed
            units = [self.pieces[p.index][1] for p in got]
            return {u: part_weight(u, self.view(layer, u, p.offset), self.fmt[layer], self.dtype)
                    for u, p in zip(units, got)}

    def release(self, layer: int, units: tuple[str, ...]) -> None:
        """Those matrices were used: their part of the buffer may take the next units."""
        with self.cond:
            for _ in units:
                self.queue.popleft()
            self.cursor = (self.first[layer] + self.units[layer].index(units[-1]) + 1) % len(self.pieces)
            self.in_use = None
            self.cond.notify_all()

    def _flush(self) -> None:
        """Drop everything read ahead (waiting for a read in flight: it writes into the buffer)."""
        self.flushing = True
        while any(not p.ready and p.error is None for p in self.queue):
            self.cond.wait()
        self.queue.clear()
        self.flushing = False

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (job := self._next_job()) is None:
                    self.cond.wait()
                if self.closed:
                    return
                layer = self.pieces[job[0]][0]
                group = []  # this layer's next units that fit now: one read of its file, in their order
                while job is not None and self.pieces[job[0]][0] == layer:
                    index, offset = job
                    group.append(Piece(index, offset, self.plan.unit_bytes[layer][self.pieces[index][1]]))
                    self.queue.append(group[-1])
                    job = self._next_job()
            targets, owner, waiting = {}, {}, {}
            for piece in group:
                unit = self.pieces[piece.index][1]
                part = part_targets(unit, self.view(layer, unit, piece.offset), self.cfg, self.fmt[layer])
                targets.update(part)
                owner.update({name: piece for name in part})
                waiting[piece.index] = len(part)

            def done(name: str, owner=owner, waiting=waiting) -> None:  # a unit is usable once its tensors are in
                piece = owner[name]
                waiting[piece.index] -= 1
                if not waiting[piece.index]:
                    with self.cond:
                        piece.ready = True
                        self.loads += 1
                        self.cond.notify_all()

            try:
                self.store.read_part(f"layer.{layer}", targets, done)
            except Exception as exc:  # any failure must reach the waiting compute thread
                error = exc if isinstance(exc, StoreError) else StoreError(f"layer {layer}: {exc!r}")
                with self.cond:
                    for piece in group:
                        if not piece.ready:
                            piece.error = error
                    self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
