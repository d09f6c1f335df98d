"""The node's compute pool: short jobs run on the event loop only once measured short and only while the compute
thread is idle (torch work on one thread at a time), everything else on the thread, every job timed in spans."""

import asyncio
import threading

import pytest
import torch

from nodes.ring.compute_pool import ComputePool, rows
from nodes.ring.spans import Spans


def where() -> str:
    return threading.current_thread().name


@pytest.fixture(autouse=True)
def one_thread():
    """A node that computes on one torch thread (a local ring's share of the cores): the one that inlines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_node_on_several_threads_keeps_every_job_on_its_thread():
    """Two OpenMP teams (the loop's and the thread's) would fight for the cores."""
    async def main():
        pool = ComputePool(Spans(), inline_s=1.0)
        loop = asyncio.get_running_loop()
        try:
            return [await loop.run_in_executor(pool, where) for _ in range(3)]
        finally:
            pool.shutdown()

    torch.set_num_threads(2)
    assert all(name.startswith("compute") for name in asyncio.run(main()))


def test_rows_counts_tensor_rows_and_ids_one_level_into_lists():
    h = torch.zeros(3, 8)
    assert [rows(args) for args in [(h,), ([h, h],), ([(h, None, 5)], 0), ([1, 2, 3],), (7,), ()]] == \
        [3, 6, 3, 3, 0, 0]


def test_a_short_kind_runs_on_the_loop_after_one_run_on_the_thread():
    async def main():
        spans = Spans()
        pool = ComputePool(spans, inline_s=1.0)
        loop = asyncio.get_running_loop()
        try:
            first = await loop.run_in_executor(pool, where)
            second = await loop.run_in_executor(pool, where)
            other_rows = await loop.run_in_executor(pool, lambda x: where(), torch.zeros(2, 1))  # a new kind
            await asyncio.sleep(0)  # the thread's timings reach the spans through the loop
            return first, second, other_rows, spans.snapshot()
        finally:
            pool.shutdown()

    first, second, other, spans = asyncio.run(main())
    assert first.startswith("compute") and second == threading.current_thread().name and other.startswith("compute")
    assert spans["where.inline"][1] == 1
    assert {"where.wait", "where.run", "where.back"} <= set(spans) and spans["where.run"][1] == 1


def test_nothing_runs_inline_while_the_thread_is_busy_or_when_jobs_are_long():
    async def main():
        pool = ComputePool(Spans(), inline_s=1.0)
        loop = asyncio.get_running_loop()
        release = threading.Event()
        try:
            await loop.run_in_executor(pool, where)  # measured short
            blocker = loop.run_in_executor(pool, release.wait)
            behind = loop.run_in_executor(pool, where)  # the thread is busy: it queues behind
            release.set()
            await blocker
            busy = await behind
            slow = ComputePool(Spans(), inline_s=0.0)  # no job is short enough
            try:
                ran = [await loop.run_in_executor(slow, where) for _ in range(3)]
            finally:
                slow.shutdown()
            return busy, ran
        finally:
            pool.shutdown()

    busy, ran = asyncio.run(main())
    assert busy.startswith("compute") and all(r.startswith("compute") for r in ran)


def test_an_inline_failure_reaches_the_caller_and_a_cancelled_job_frees_the_thread():
    def boom(x):
        raise ValueError(f"bad {x}")

    async def main():
        pool = ComputePool(Spans(), inline_s=1.0)
        loop = asyncio.get_running_loop()
        release = threading.Event()
        try:
            for _ in range(2):  # on the thread, then inline: the same error both times
                with pytest.raises(ValueError, match="bad 1"):
                    await loop.run_in_executor(pool, boom, 1)
            await loop.run_in_executor(pool, where)  # measured short
            blocker = loop.run_in_executor(pool, release.wait)
            queued = loop.run_in_executor(pool, where)
            queued.cancel()  # never runs: its place on the thread must be given back
            release.set()
            await blocker
            await asyncio.sleep(0.05)
            return await loop.run_in_executor(pool, where)
        finally:
            pool.shutdown()

    assert asyncio.run(main()) == threading.current_thread().name  # idle again: the short kind runs inline
