"""run_ahead (nodes/ring/run_ahead.py): the head's generation loop goes on while the Generate call writes its
tokens; what it yields arrives in order, its failures reach the consumer, and a consumer that leaves (a client
gone) stops it where it waits, running its cleanup."""

import asyncio

import pytest

from nodes.ring.run_ahead import run_ahead


async def produce(n: int, log: list, fail: bool = False, hang: bool = False):
    try:
        for i in range(n):
            log.append(f"made {i}")
            yield i
        if fail:
            raise ValueError("the ring failed")
        if hang:
            await asyncio.Event().wait()
    finally:
        log.append("cleaned up")


def test_items_arrive_in_order_while_the_producer_runs_ahead():
    async def main():
        log, got = [], []
        async for i in run_ahead(produce(4, log)):
            got.append(i)
            log.append(f"used {i}")
            await asyncio.sleep(0.01)  # a slow client write: the producer does not wait for it
        return got, log

    got, log = asyncio.run(main())
    assert got == [0, 1, 2, 3]
    assert log.index("made 3") < log.index("used 1")
    assert log[-1] == "used 3" and "cleaned up" in log


def test_the_producers_failure_reaches_the_consumer_after_its_items():
    async def main():
        got = []
        with pytest.raises(ValueError, match="the ring failed"):
            async for i in run_ahead(produce(2, [], fail=True)):
                got.append(i)
        return got

    assert asyncio.run(main()) == [0, 1]


def test_a_consumer_that_leaves_stops_the_producer_where_it_waits():
    async def main():
        log = []
        async for _ in run_ahead(produce(1, log, hang=True)):
            break
        return log

    assert asyncio.run(main())[-1] == "cleaned up"


def test_a_cancelled_consumer_cancels_the_producer_and_stays_cancelled():
    async def main():
        log = []

        async def consume():
            async for _ in run_ahead(produce(1, log, hang=True)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return log

    assert asyncio.run(main())[-1] == "cleaned up"
