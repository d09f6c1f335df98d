"""`prima-node --join MEMBER`: a new node asks any member for the ring's head and asks the head to insert it before
itself; the head makes it a relay of the running ring and gives it layers at the next re-plan (which it fetches).

A ring mid-change (its head just lost and not yet replaced, a re-plan loading layers) answers with a retriable
status: the node asks again with back-off, of every node it has heard of, until the ring settles or the deadline."""

import asyncio

import grpc

from nodes.ring.members import DEADLINES
from prima_rpc.control import AioControl
from prima_rpc.retry import RETRIABLE, pauses, settle_seconds


class JoinError(Exception):
    """The node could not join; the ring is as it was."""


class _NotYet(Exception):
    """A try that a settled ring may answer differently: why, for the last line."""


async def join_ring(node, member: str, seconds: float | None = None) -> list[str]:
    """Join the ring `member` belongs to; the ring with this node, the head first. JoinError says why not, after
    `seconds` (default: PRIMA_RETRY_S or 60) of retries when the ring is changing."""
    seconds = settle_seconds() if seconds is None else seconds
    known = [member]  # whom to ask: the member given, then the nodes it named (its head, its ring)
    tries, why = pauses(seconds), ""
    while True:
        for asked in list(known):
            try:
                ring = await _join_once(node, asked, known)
            except _NotYet as exc:
                why = str(exc)
                continue
            node.log.info("joined the ring", ring=ring)
            return ring
        pause = next(tries, None)
        if pause is None:
            raise JoinError(f"cannot join the ring of {member}: {why}"
                            + (f" (the ring did not settle within {seconds:.0f} s)" if seconds else ""))
        node.log.info("the ring is changing; asking again", why=why, pause_s=round(pause, 2))
        await asyncio.sleep(pause)


async def _join_once(node, member: str, known: list[str]) -> list[str]:
    token = node.cfg.token
    try:
        async with AioControl(member, token, DEADLINES) as peer:
            info = await peer.info()
        head = info.address if info.role == "head" else info.head
        for named in (head, info.peer, *info.ring, *(m.address for m in info.members)):
            if named and named not in known and named != node.address:
                known.append(named)
        if not head:
            raise JoinError(f"{member} is not in a running ring (no head: prima-ctl start it first)")
        async with AioControl(head, token, DEADLINES) as peer:
            head_info = await peer.info()
            if head_info.role != "head":  # a head that stepped down, or one a failover has not replaced yet
                raise _NotYet(f"{head} (the head {member} names) is no longer the ring's head")
            ours = node.store.model_id if node.store is not None else ""
            if ours and ours != head_info.model_id:
                raise JoinError(f"this node's store holds model {ours[:12]} ({node.store.manifest.name}), the ring "
                                f"runs {head_info.model_id[:12]} ({head_info.model_name}): start it without --model "
                                "(it fetches the ring's) or with the ring's store")
            await node.set_peer(head)
            reply = await peer.join(node.address, ours)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in RETRIABLE:
            raise _NotYet(f"{exc.code().name}: {exc.details()}") from None
        raise JoinError(f"cannot join the ring of {member}: {exc.code().name}: {exc.details()}") from None
    return list(reply.ring)
