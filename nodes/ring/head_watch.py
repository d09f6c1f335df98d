"""A member's watch over its head: probe it every second; when it is lost, the survivors agree on a new head without
talking it over (recovery.new_head: the first member after it in ring order with a complete copy of its units), and
that member takes over: it becomes the head, routes around the lost one and re-plans the ring."""

import asyncio

import grpc

from nodes.ring import recovery
from nodes.ring.join import JoinError, join_ring
from nodes.ring.members import DEADLINES, PROBE_INTERVAL
from prima_rpc.control import AioControl, Deadlines
from prima_rpc.v1 import prima_pb2 as pb

# Before a member takes over, one last probe with a longer deadline: a head that is slow (loading, a busy machine)
# rather than gone answers it, and no second head is made. A killed head refuses it at once.
CONFIRM = Deadlines(info=5.0)


class HeadWatch:
    """Held by every node; it acts only while the node is a member (not the head) of an assigned ring."""

    def __init__(self, node):
        self.node = node
        self.watched = ""  # the head the misses count for
        self.misses = 0
        self.loading = False  # the head's last answer said it loads an assignment: it may answer late

    async def round(self) -> None:
        await asyncio.sleep(PROBE_INTERVAL)
        node = self.node
        head, ring = node.head_address, node.standby.ring
        if (node.head is not None or node.windows is None or node.fetching or not head or head == node.address
                or len(ring) < 2):
            return
        if head != self.watched:
            self.watched, self.misses, self.loading = head, 0, False
        epoch = node.epoch
        if (info := await info_of(head, node.cfg.token)) is not None:
            self.misses, self.loading = 0, info.state == "fetching"
            return
        self.misses += 1
        busy = bool(node.shard and node.shard.caches)
        if self.misses < recovery.misses_allowed(busy, self.loading) or node.fetching or node.epoch != epoch:
            return  # not yet; or this node was assigned while it probed (the head is alive)
        if await info_of(head, node.cfg.token, CONFIRM) is not None or node.head is not None:
            self.misses = 0
            return
        others = [a for a in ring if a not in (head, node.address)]
        infos = await asyncio.gather(*(info_of(a, node.cfg.token) for a in others))
        copies = {a: i.head_copy for a, i in zip(others, infos) if i is not None}
        copies[node.address] = node.holds_head_copy()
        chosen = recovery.new_head(tuple(ring), head, copies)
        node.log.warning("the head does not answer", head=head, new_head=chosen or "none has a complete copy")
        if chosen == node.address:
            await node.take_over(head, ring)
        elif chosen:
            await join_if_left_out(node, chosen)


async def join_if_left_out(node, chosen: str) -> None:
    """Join the new head's ring when it took over without this node: a node that joined after the last assignment
    is in no other member's ring list, so the standby's re-plan routes around it and it would follow a dead head."""
    info = await info_of(chosen, node.cfg.token)
    if info is None or info.role != "head" or node.address in {m.address for m in info.members}:
        return  # not (yet) the head; or it knows this node
    node.log.warning("the new head took over without this node; joining its ring", head=chosen)
    try:
        await join_ring(node, chosen, seconds=10.0)
    except JoinError as exc:  # the next round tries again
        node.log.warning("could not join the new head's ring", error=str(exc))



async def info_of(address: str, token: str | None, deadlines: Deadlines = DEADLINES) -> pb.NodeInfo | None:
    try:
        async with AioControl(address, token, deadlines) as peer:  # a fresh channel: a dead head fails at once
            return await peer.info()
    except grpc.RpcError:
        return None
