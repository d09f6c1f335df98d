"""A node's inbox: a FIFO queue from which the compute loop can also take the frames that join a batch, leaving
the others in their order."""

import asyncio
from collections import deque
from collections.abc import Callable


class Inbox(asyncio.Queue):
    def _init(self, maxsize: int) -> None:
        self._queue: deque = deque()
        self._arrived = asyncio.Event()

    def _put(self, item) -> None:
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
