"""A graceful end of the head (SIGTERM, or `prima-ctl leave HEAD`): it hands its role to the standby, the first member
in ring order with a complete copy of its units, which re-plans the ring as on a failover; the old head then ends its
requests, and clients that know several members resume them on the new head. No member waits to detect a loss."""

import asyncio

import grpc

from nodes.errors import Rejected
from nodes.ring import head_watch, recovery
from prima_rpc.control import AioControl, Deadlines

DEADLINES = Deadlines(info=2.0, leave=600.0)  # the standby's re-plan may load (and fetch) layers


async def hand_over(node, forget: bool) -> list[str]:
    """(The head) make the standby the head; forget: this node leaves for good (it does not rejoin). The new ring,
    its head first. Rejected: no member answers with a complete copy of the head's units."""
    head = node.head
    ring = [head.address, *head.members.members]
    infos = await asyncio.gather(*(head_watch.info_of(a, node.cfg.token) for a in ring[1:]))
    copies = {a: i.head_copy for a, i in zip(ring[1:], infos) if i is not None}
    chosen = recovery.new_head(tuple(ring), ring[0], copies)
    if chosen is None:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "no member holds a complete copy of the head's units "
                                                            "(status: standby...); try again once it has one")
    node.log.info("handing the head role over", to=chosen, forget=forget)
    async with head.members.lock:  # this head's watch decides nothing while the standby re-plans the ring
        head.members.generation += 1
        try:
            async with AioControl(chosen, node.cfg.token, DEADLINES) as peer:
                reply = await peer.take_over(ring[0], ring, forget)
        except grpc.RpcError as exc:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, f"{chosen} did not take over: {exc.code().name}: "
                                                        f"{exc.details()}") from None
        # Requests here end now; their clients find the new head (named in Info) and resume there.
        await node.step_down(chosen, f"{node.cfg.name or node.address} handed the head role to {chosen}")
    return list(reply.ring)


async def take_over(node, lost: str, ring: list[str], forget: bool) -> list[str]:
    """(The standby) become the head of `ring` in place of `lost`, which hands over; the new ring, this node first."""
    if node.head is not None:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "this node is the head already")
    if node.address not in ring or lost not in ring:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{node.address} and {lost} must both be in the ring")
    if not node.holds_head_copy():
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"{node.address} lacks a complete copy of the head's units")
    await node.take_over(lost, ring, handed=True, forget=forget)
    return [node.head.address, *node.head.members.members]
