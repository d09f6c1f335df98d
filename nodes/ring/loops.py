"""A node's long-running coroutines beside its compute loop (Node.run starts them): sending frames, watching the
ring's members or its head, giving memory back to the device's owner, and (the head) re-planning live."""

import asyncio
import time

from nodes.errors import LinkDown


async def send(node) -> None:
    """Frames from the outbox to the successor, one after another."""
    while True:
        frame = await node.outbox.get()
        start = time.perf_counter()
        try:
            await node.link.send(frame)
        except LinkDown as exc:
            node.last_error = str(exc)
            node.log.warning("link down", error=str(exc))
            if node.head is not None and node.head.requests.known(frame.request_id):
                node.head.members.link_down(frame.request_id, str(exc))
        node.stats.link_s += (took := time.perf_counter() - start)
        node.spans.add("send", took)


async def watch(node) -> None:
    """The head probes its members every second (members.py); members probe the head (head_watch.py)."""
    while True:
        head = node.head
        if head is None:
            await node.head_watch.round()
        else:
            await head.members.round()


async def owner(node) -> None:
    """Every node gives memory back when its device's owner needs it (nodes/ring/owner.py)."""
    while True:
        await node.memory_watch.round()


async def replan(node) -> None:
    """The head re-plans the ring live when a device drifts from the plan (nodes/ring/replanner.py)."""
    while True:
        head = node.head
        if head is None:
            await asyncio.sleep(1.0)
            continue
        try:
            await head.replanner.round()
        except Exception:  # a failed re-plan must not stop the ring: it serves on the plan it has
            node.log.exception("live re-plan failed")
            await asyncio.sleep(5.0)
