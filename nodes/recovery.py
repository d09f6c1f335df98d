"""The head's watch over its ring: detect a lost node within seconds, re-plan on the survivors, resume.

While requests are in flight the head probes every member (Control.Info, short deadline). When one
does not answer, it rewires the survivors round the lost node (Control.SetPeer), assigns them new
windows under a new epoch (frames of the old ring are dropped everywhere), and the waiting requests
replay their tokens on the new ring. If the survivors cannot hold the model, the requests end with
UNAVAILABLE naming the lost node.
"""

import asyncio

import grpc
import structlog

from nodes.routing import Windows
from prima_rpc.channel import aio_channel, metadata
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc
from solver.plan import even_windows, layer_ranges

log = structlog.get_logger()
PROBE_TIMEOUT = 2.0


class Members:
    """Async Control stubs to the other ring members, by address."""

    def __init__(self, token: str | None):
        self.md = metadata(token)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def control(self, address: str) -> rpc.ControlStub:
        if address not in self._channels:
            self._channels[address] = aio_channel(address)
        return rpc.ControlStub(self._channels[address])

    async def info(self, address: str) -> pb.NodeInfo:
        return await self.control(address).Info(pb.InfoRequest(), metadata=self.md, timeout=PROBE_TIMEOUT)


async def watch(node, interval: float = 1.0) -> None:
    members = Members(node.cfg.token)
    while True:
        await asyncio.sleep(interval)
        if node.role != "head":
            continue
        if node.requests and node.members:
            await check_members(node, members)
        elif node.lost and not node.requests:
            await check_rejoin(node, members)


async def check_members(node, members: Members) -> None:
    ring = list(node.members)
    answers = await asyncio.gather(*(members.info(a) for a in ring), return_exceptions=True)
    lost = [a for a, r in zip(ring, answers) if isinstance(r, BaseException)]
    if lost:
        alive = [(a, r) for a, r in zip(ring, answers) if not isinstance(r, BaseException)]
        await recover(node, members, alive, lost)


async def check_rejoin(node, members: Members) -> None:
    """A lost node that answers again (restarted, not yet assigned) is wired back in its old place."""
    lost = sorted(node.lost)
    answers = await asyncio.gather(*(members.info(a) for a in lost), return_exceptions=True)
    back = {a for a, r in zip(lost, answers) if not isinstance(r, BaseException) and r.role == "idle"}
    if not back:
        return
    order = [a for a in node.original if a not in node.lost or a in back]
    infos = await asyncio.gather(*(members.info(a) for a in order), return_exceptions=True)
    if any(isinstance(r, BaseException) for r in infos):
        return  # someone else went missing meanwhile: try again next round
    node.log.info("lost nodes are back: re-planning with them", back=sorted(back))
    node.ring_ready.clear()
    try:
        await replan(node, members, list(zip(order, infos)))
        node.lost -= back
    except Exception as exc:  # the ring stays as it was; the next round tries again
        node.log.warning("rejoin failed", error=str(exc))
    finally:
        node.ring_ready.set()


async def recover(node, members: Members, survivors: list[tuple[str, pb.NodeInfo]], lost: list[str]) -> None:
    node.lost |= set(lost)
    node.log.warning("ring members lost: re-planning on the survivors", lost=lost,
                     survivors=[a for a, _ in survivors])
    node.ring_ready.clear()
    for req in node.requests.values():
        req.ring_changed()
    try:
        await replan(node, members, survivors)
    except Exception as exc:  # every failure here ends the requests with the reason
        message = f"lost node(s) {', '.join(lost)} and the survivors cannot take over: {exc}"
        node.log.error("recovery failed", error=message)
        node.members = [a for a, _ in survivors]
        for req in node.requests.values():
            req.fail(message)
    finally:
        node.ring_ready.set()


async def replan(node, members: Members, survivors: list[tuple[str, pb.NodeInfo]]) -> None:
    """Rewire and re-assign: an even split over the survivors with a model; the rest relay."""
    n_layers = node.store.config.n_layers
    holders = [a for a, info in survivors if info.n_layers == n_layers and info.model_id == node.store.model_id]
    sizes = even_windows(n_layers, 1 + len(holders))  # the head first
    windows = [sizes[0]] + [sizes[1 + holders.index(a)] if a in holders else 0 for a, _ in survivors]
    ranges = layer_ranges(windows, n_layers)
    epoch = node.epoch + 1
    addresses = [node.ring_address] + [a for a, _ in survivors]
    for i, (address, _) in enumerate(survivors):  # each survivor's successor is the next survivor
        await members.control(address).SetPeer(pb.SetPeerRequest(peer=addresses[(i + 2) % len(addresses)]),
                                                metadata=members.md, timeout=PROBE_TIMEOUT)
    node.set_peer(addresses[1 % len(addresses)])

    async def assign(address: str, own: list[tuple[int, int]]) -> None:
        req = pb.AssignRequest(windows=[pb.LayerRange(start=a, stop=b) for a, b in own], head=False,
                               model_id=node.store.model_id, ring_layers=n_layers, epoch=epoch, replan=True)
        async for _ in members.control(address).Assign(req, metadata=members.md, timeout=120):
            pass

    remote = [assign(a, r) for (a, _), r in zip(survivors, ranges[1:])]
    head = node.assign(Windows(tuple(ranges[0]), n_layers, True), node.store.model_id, lambda *a: None,
                       epoch=epoch, replan=True, ring=addresses)
    await asyncio.gather(head, *remote)
    node.log.info("ring re-planned", windows=windows, epoch=epoch)

