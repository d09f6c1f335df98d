"""A node's inbox: a FIFO queue from which the compute loop can also take the frames that join a batch, leaving
the others in their order. It drops the frames of cancelled speculative windows (nodes/ring/inflight.py): a
frame that says a request's steps below `live_from` were cancelled removes those waiting here, and any that
come later (a later round of a k > 1 ring), until the request's RELEASE."""

import asyncio
from collections import deque
from collections.abc import Callable

from prima_rpc.v1 import prima_pb2 as pb

MARKS = 4096  # requests whose cancelled windows an inbox remembers


class Inbox(asyncio.Queue):
    def _init(self, maxsize: int) -> None:
        self._queue: deque = deque()
        self._arrived = asyncio.Event()
        self.live_from: dict[tuple[str, int], int] = {}  # (request id, epoch) -> its steps below were cancelled
        self.dropped = 0  # frames of cancelled windows dropped here

    def _put(self, item) -> None:
        # A request's steps are numbered by its head in one epoch (a new head numbers afresh after a failover).
        rid = (getattr(item, "request_id", None), getattr(item, "epoch", 0))
        window, live_from = getattr(item, "window", 0), getattr(item, "live_from", 0)
        if live_from and live_from > self.live_from.get(rid, 0):
            if len(self.live_from) >= MARKS:  # requests that never released (their head was lost)
                del self.live_from[next(iter(self.live_from))]
            self.live_from[rid] = live_from
            kept = deque(w for w in self._queue if not _void(w, rid, live_from))
            self.dropped += len(self._queue) - len(kept)
            for _ in range(len(self._queue) - len(kept)):  # room for as many waiting producers
                self._wakeup_next(self._putters)
            self._queue = kept
        if window and window < self.live_from.get(rid, 0):
            self.dropped += 1
            return
        if getattr(item, "kind", None) == pb.RELEASE:
            self.live_from.pop(rid, None)
        self._queue.append(item)
        self._arrived.set()

    def take(self, joins: Callable[[object], bool], limit: int) -> list:
        """Remove and return (in order) up to `limit` waiting items for which joins(item) holds."""
        taken, kept = [], deque()
        for item in self._queue:
            (taken if len(taken) < limit and joins(item) else kept).append(item)
        if taken:
            self._queue = kept
            for _ in taken:  # room for as many waiting producers
                self._wakeup_next(self._putters)
        return taken

    async def arrival(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the next item put; True when one came."""
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), timeout)
            return True
        except TimeoutError:
            return False


def _void(w, request: tuple[str, int], live_from: int) -> bool:
    """A frame of a cancelled window of `request` (its id and epoch)."""
    return (w.request_id, w.epoch) == request and w.kind == pb.FORWARD and 0 < w.window < live_from
