"""An async generator run ahead of its consumer, in a task of its own: what it yields waits in a queue while the
consumer is busy. The head's generation loop yields each token to the Generate call, whose write to the client
went through gRPC's core before the loop could send the next step into the ring: the write was on every token's
path. Run ahead, the loop sends the next step at once and the write happens while the ring computes."""

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import TypeVar

T = TypeVar("T")
_END = object()


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


async def run_ahead(gen: AsyncIterator[T]) -> AsyncIterator[T]:
    """gen's items in order, and its exception where it raises one; leaving early (the consumer's own failure, or
    its cancellation: a client gone) cancels gen where it waits, so its cleanup runs."""
    queue: asyncio.Queue = asyncio.Queue()  # bounded by what gen yields: a request's tokens
    loop = asyncio.get_running_loop()
    # Each item is queued one loop turn later (call_soon keeps their order): what gen set going before it next
    # waits (the head's next step into the ring) runs before the consumer wakes, not after.
    put = partial(loop.call_soon, queue.put_nowait)

    async def pump() -> None:
        try:
            async for item in gen:
                put(item)
        except Exception as exc:  # handed to the consumer, raised there
            put(_Raised(exc))
        finally:
            put(_END)

    task = loop.create_task(pump())
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, _Raised):
                raise item.exc
            yield item
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():  # the consumer itself was cancelled while waiting here: go on cancelling
                raise
