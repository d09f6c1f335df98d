"""`prima-node --join MEMBER`: a new node asks any member for the ring's head and asks the head to insert it before
itself; the head makes it a relay of the running ring and gives it layers at the next re-plan (which it fetches)."""

import grpc

from nodes.ring.head_watch import DEADLINES
from prima_rpc.control import AioControl


class JoinError(Exception):
    """The node could not join; the ring is as it was."""


async def join_ring(node, member: str) -> list[str]:
    """Join the ring `member` belongs to; the ring with this node, the head first. JoinError says why not."""
    token = node.cfg.token
    try:
        async with AioControl(member, token, DEADLINES) as peer:
            info = await peer.info()
        head = info.address if info.role == "head" else info.head
        if not head:
            raise JoinError(f"{member} is not in a running ring (no head: prima-ctl start it first)")
        async with AioControl(head, token, DEADLINES) as peer:
            head_info = await peer.info()
            ours = node.store.model_id if node.store is not None else ""
            if ours and ours != head_info.model_id:
                raise JoinError(f"this node's store holds model {ours[:12]} ({node.store.manifest.name}), the ring "
                                f"runs {head_info.model_id[:12]} ({head_info.model_name}): start it without --model "
                                "(it fetches the ring's) or with the ring's store")
            await node.set_peer(head)
            reply = await peer.join(node.address, ours)
    except grpc.aio.AioRpcError as exc:
        raise JoinError(f"cannot join the ring of {member}: {exc.code().name}: {exc.details()}") from None
    node.log.info("joined the ring", ring=list(reply.ring))
    return list(reply.ring)
