"""A compute job awaited on the event loop without a trip through the loop when it needs none."""

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


async def run_job(pool: Executor, fn: Callable, /, *args) -> Any:
    """fn(*args) on `pool`, awaited. A job the pool ran at once (nodes/ring/compute_pool.py runs short ones inline)
    returns its result here directly: loop.run_in_executor would wrap its finished future, wake the loop through
    its self-pipe and resume this coroutine two loop turns later, ~0.25 ms a hand-off on a 2-core AVX2 VM, four
    hand-offs a token on the head's path (a traced 3-node ring)."""
    fut = pool.submit(fn, *args)
    if fut.done():
        return fut.result()
    return await asyncio.wrap_future(fut)
