"""The head's watch over its members, always on: probe each every second, perform what recovery decides.

Lost members are routed around and the survivors re-planned under a new epoch (frames of the old
ring are dropped everywhere; waiting requests replay); a lost member that answers again is wired
back in its old place. The decisions are pure functions in nodes/ring/recovery.py; this module does I/O.
"""

import asyncio
import time
from dataclasses import replace

import grpc

from nodes.errors import Rejected, RequestFailed
from nodes.ring import recovery
from nodes.ring.assignment import Assignment, Place
from nodes.ring.head_port import NodePort
from nodes.ring.head_requests import HeadRequests
from nodes.ring.recovery import Grow, Keep, Probe, Rejoin, RingView, RouteAround
from prima_rpc.control import AioControl, Deadlines, assign_request
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.windows import Windows
from prima_rpc.v1 import prima_pb2 as pb

PROBE_INTERVAL = 1.0
DEADLINES = Deadlines(info=2.0, set_peer=2.0, assign=120.0)  # a probe answers within 2 s, or counts as a miss
DRAIN = 2.0  # seconds a rewired link has to deliver the frames already written to the old successor
REPLAN_ERRORS = (grpc.RpcError, Rejected, StoreError, ValueError, OSError)  # a re-plan that cannot be done


class Members:
    """The head's members: their addresses and states, and Control channels to them."""

    def __init__(self, node: NodePort, requests: HeadRequests):
        self.node, self.requests = node, requests
        self.token = node.cfg.token
        self.head = ""  # the head's address as its predecessor dials it
        self.members: tuple[str, ...] = ()  # the ring now, without the head
        self.original: tuple[str, ...] = ()  # as prima-ctl started it: the order lost members rejoin in
        self.lost: frozenset[str] = frozenset()
        self.joined: frozenset[str] = frozenset()  # relays that joined since the last plan
        self.draining: frozenset[str] = frozenset()  # a head that handed over: not back until it was silent once
        self.misses: dict[str, int] = {}
        self.answers: dict[str, Probe] = {}  # the last round's
        self.wake = asyncio.Event()  # a frame could not be sent: probe now
        self.link_failures: dict[str, str] = {}  # request id -> why its frame was not sent
        self.generation = 0  # counts the changes of the ring: a probe round that straddles one decides nothing
        self.lock = asyncio.Lock()  # one change of the ring at a time (a round's decision, a join, a leave)
        self._peers: dict[str, AioControl] = {}
        self.closed = False  # its head closed: no longer the node's

    def set_ring(self, head: str, members: list[str], fresh: bool) -> None:
        self.head, self.members = head, tuple(members)
        self.generation += 1
        if fresh:  # a ring from prima-ctl forgets the old one's losses
            self.original, self.lost, self.misses, self.answers = tuple(members), frozenset(), {}, {}
            self.joined = frozenset()

    def view(self) -> RingView:
        return RingView(self.head, self.members, self.original, self.lost, tuple(self.misses.items()),
                        busy=bool(self.requests), joined=self.joined)

    def states(self) -> list[tuple[str, str]]:
        """(address, state) of every member, the head first; none before a ring names the head."""
        if not self.head:
            return []
        return [(a, s.value) for a, s in recovery.member_states(self.view(), self.answers)]

    def link_down(self, request_id: str, message: str) -> None:
        """The head could not send a request's frame: find out now whether its successor is lost."""
        self.link_failures[request_id] = message
        self.wake.set()

    # ------------------------------------------------------------------ the loop

    async def round(self) -> None:
        """Wait a probe interval (less if a send failed), then check every member."""
        try:
            await asyncio.wait_for(self.wake.wait(), PROBE_INTERVAL)
        except TimeoutError:
            pass
        self.wake.clear()
        if self.head:
            await self.check()

    async def check(self) -> None:
        """One probe round and what it decides. While this node is being assigned (prima-ctl start), and when the
        ring changed while the probes were out (a join, a leave, a hand-over hold the lock), the round decides
        nothing: its answers are of another ring."""
        if self.node.fetching or self.lock.locked():
            return
        generation, targets = self.generation, recovery.probed(self.view())
        infos = await asyncio.gather(*(self._info(a) for a in targets))
        async with self.lock:
            if generation != self.generation or self.node.fetching:
                return
            newer = recovery.newer_ring(self.head, self.node.epoch, {a: (_head_of(i), i.epoch)
                                                                     for a, i in zip(targets, infos) if i is not None})
            if newer is not None:
                await self._step_down(*newer)
            else:
                await self._decide(targets, infos)

    async def _decide(self, targets: tuple[str, ...], infos: list[pb.NodeInfo | None]) -> None:
        answers = {a: self._probe(a, info) for a, info in zip(targets, infos)}
        self.draining = frozenset(a for a, i in zip(targets, infos) if a in self.draining and i is not None)
        self.misses = dict(recovery.tally(self.misses, answers))
        self.answers = answers
        decision = recovery.decide(replace(self.view(), misses=tuple(self.misses.items())), answers)
        failures, self.link_failures = self.link_failures, {}
        match decision:
            case RouteAround():
                await self._route_around(decision, answers)
            case Rejoin():
                await self._rejoin(decision, answers)
            case Grow():
                await self._grow(decision, answers)
            case Keep():  # everyone answers: a frame lost on a broken link ends its request
                for request_id, message in failures.items():
                    self.requests.fail(request_id, _unavailable(message))

    def _probe(self, address: str, info: pb.NodeInfo | None) -> Probe:
        """A member's answer; a miss keeps what its last answer said of loading (a loading node answers late)."""
        if info is None:
            return Probe(False, loading=self.answers.get(address, Probe(False)).loading)
        return Probe(address not in self.draining, self._holds_model(info), info.state == "fetching")

    async def _step_down(self, head: str, epoch: int) -> None:
        """Split brain: a member follows a newer ring, so this head was cut off and another took over. It gives way
        at once: its requests end UNAVAILABLE naming the new head (clients that know several members resume
        there), it serves no frames, and the new head wires it back in as a member when it sees it answer."""
        node = self.node
        if self.closed:  # its head already gave way
            return
        node.log.warning("a newer ring has another head: stepping down", head=head, epoch=epoch, ours=node.epoch)
        await node.step_down(head, f"{node.cfg.name or node.address} is no longer the ring's head: {head} took over "
                                   f"(epoch {epoch})")

    async def _route_around(self, d: RouteAround, answers: dict[str, Probe]) -> None:
        node = self.node
        self.lost |= set(d.lost)
        node.log.warning("ring members lost: re-planning on the survivors", lost=list(d.lost),
                         survivors=list(d.survivors))
        with self.requests.replanning():
            try:
                await self._apply({a: answers[a] for a in d.survivors})
            except REPLAN_ERRORS as exc:  # the requests end with the reason; the next round tries again
                message = f"lost node(s) {', '.join(d.lost)} and the survivors cannot take over: {_why(exc)}"
                node.log.error("recovery failed", error=message)
                node.last_error = message
                self.members = d.survivors
                self.requests.fail_all(_unavailable(message))

    async def take_over(self, lost: str, order: tuple[str, ...], handed: bool = False, forget: bool = False) -> None:
        """This node replaces the lost head: probe the others and re-plan on those that answer. order: the ring
        after this node, the lost head in its place (where it rejoins when it answers again). handed: it handed
        over and answers until it stops (it rejoins only once it was silent); forget: it never rejoins."""
        async with self.lock:
            await self._take_over(lost, order, handed, forget)

    async def _take_over(self, lost: str, order: tuple[str, ...], handed: bool, forget: bool) -> None:
        self.original, self.lost = order, frozenset({lost})
        self.draining = frozenset({lost}) if handed else frozenset()
        others = tuple(a for a in order if a != lost)
        infos = await asyncio.gather(*(self._info(a) for a in others))
        self.answers = {a: Probe(i is not None, i is not None and self._holds_model(i)) for a, i in zip(others, infos)}
        gone = tuple(a for a in others if not self.answers[a].answered)
        await self._route_around(RouteAround((lost, *gone), tuple(a for a in others if a not in gone)), self.answers)
        if forget:
            self.forget(lost)

    async def leave(self, address: str) -> list[str]:
        """Take a member out of the ring: re-plan without it (waiting requests replay on the new ring), then stop
        it; it is forgotten (it does not rejoin). Rejected: the head itself, not a member, or no re-plan."""
        async with self.lock:  # a probe round under way decides nothing on the ring it changes
            self.generation += 1
            try:
                return await self._leave(address)
            finally:
                self.generation += 1

    async def _leave(self, address: str) -> list[str]:
        if address == self.head or address == self.node.address:
            last = not self.members
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"{address} is the ring's " + (
                "last node: nothing to leave to" if last else "head: stop it (prima-ctl down) to fail over, "
                                                              "or start the ring with another head"))
        if address not in self.members:
            raise Rejected(grpc.StatusCode.NOT_FOUND, f"{address} is not a member of this ring: "
                           + ", ".join([self.head, *self.members]))
        rest = tuple(a for a in self.members if a != address)
        infos = await asyncio.gather(*(self._info(a) for a in rest))
        if any(i is None for i in infos):
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "a member does not answer; try again once the ring healed")
        self.node.log.info("a member leaves the ring: re-planning without it", leaving=address)
        with self.requests.replanning():
            try:
                await self._apply({a: Probe(True, self._holds_model(i)) for a, i in zip(rest, infos)})
            except REPLAN_ERRORS as exc:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"cannot re-plan without {address}: "
                                                                     f"{_why(exc)}") from None
        self.original = tuple(a for a in self.original if a != address)
        try:
            await self._control(address).shutdown()
        except grpc.RpcError as exc:
            self.node.log.warning("the node that left did not stop", address=address, error=_why(exc))
        return [self.head, *self.members]

    async def join(self, address: str, model_id: str) -> list[str]:
        """Insert a new node before the head (the head's predecessor now sends to it) as a relay of the current
        epoch, so that requests in flight go on through it and none replays; it takes layers at the next re-plan
        (idle, when it holds the model; else prima-ctl start). Rejected: already a member, another model, silent."""
        async with self.lock:  # a probe round under way decides nothing on the ring it changes
            self.generation += 1
            try:
                return await self._join(address, model_id)
            finally:
                self.generation += 1

    async def _join(self, address: str, model_id: str) -> list[str]:
        node, ring = self.node, [self.head, *self.members]
        if address in ring or address == node.address:
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"{address} is already a member of this ring")
        if model_id and model_id != node.store.model_id:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"{address} holds model {model_id[:12]}, the ring "
                           f"runs {node.store.model_id[:12]} ({node.store.manifest.name}): start it without --model "
                           "(it fetches the ring's) or with the ring's store")
        if await self._info(address) is None:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, f"{address} does not answer the head")
        ring.append(address)
        n_layers = node.store.config.n_layers
        peer = self._control(address)
        await peer.set_peer(self.head)
        req = assign_request((), n_layers, node.store.model_id, node.epoch, ring=ring, head_address=self.head,
                             head_windows=node.windows.ranges)
        async for _ in peer.assign(req):
            pass
        before = self.members[-1] if self.members else None  # the head's predecessor: it sends to the new node
        if before is None:
            await node.set_peer(address, DRAIN)
        else:
            await self._control(before).set_peer(address, drain=True)
        self.members, self.original = (*self.members, address), (*self.original, address)
        self.joined |= {address}
        node.log.info("a node joined the ring before the head", joined=address, ring=ring)
        return ring

    def forget(self, address: str) -> None:
        """A member that left for good (a head that handed over): it does not rejoin when it answers again."""
        self.original = tuple(a for a in self.original if a != address)
        self.lost -= {address}

    async def _grow(self, d: Grow, answers: dict[str, Probe]) -> None:
        self.node.log.info("re-planning with the nodes that joined", joined=list(d.joined))
        with self.requests.replanning():
            try:
                await self._apply({a: answers[a] for a in d.order})
            except REPLAN_ERRORS as exc:  # the ring stays as it was (the joined stay relays)
                self.node.log.warning("re-plan with the joined nodes failed", error=_why(exc))
        self.joined = frozenset()

    async def _rejoin(self, d: Rejoin, answers: dict[str, Probe]) -> None:
        self.node.log.info("lost nodes are back: re-planning with them", back=list(d.back))
        with self.requests.replanning():
            try:
                await self._apply({a: answers[a] for a in d.order})
                self.lost -= set(d.back)
            except REPLAN_ERRORS as exc:  # the ring stays as it was; the next round tries again
                self.node.log.warning("rejoin failed", error=_why(exc))

    async def replan_to(self, plan: recovery.Replan, predicted: list[float], tpot_ms: float,
                        buffers: list[float]) -> None:
        """Move the ring's windows to `plan` (same members, same order) while requests are in flight: they replay
        on the new windows (nodes/ring/replanner.py decides when). predicted, buffers: per node, the head first."""
        async with self.lock:
            self.generation += 1
            with self.requests.replanning():
                await self._apply({a: Probe(True, True) for a in self.members}, plan,
                                  (predicted, tpot_ms), buffers)

    async def _apply(self, members: dict[str, Probe], plan: recovery.Replan | None = None,
                     predicted: tuple[list[float], float] | None = None, buffers: list[float] | None = None) -> None:
        """Rewire and re-assign the ring [head, *members] under a new epoch: to `plan` with its predictions and
        stream buffers, or (none) an even split over the model's holders."""
        node = self.node
        n_layers, model_id = node.store.config.n_layers, node.store.model_id
        plan = plan or recovery.replan(self.head, members, n_layers)
        per_node, tpot_ms = predicted or ([0.0] * (1 + len(members)), 0.0)
        buffers = buffers or [0.0] * (1 + len(members))
        # newer than every ring before (prima-ctl start's are milliseconds too), and two heads of a split brain that
        # re-plan apart do not share one: recovery.newer_ring tells them apart
        epoch = max(node.epoch + 1, time.time_ns() // 1_000_000)
        self.generation += 1
        for address, peer in plan.peers[1:]:
            await self._control(address).set_peer(peer)
        await node.set_peer(plan.peers[0][1])

        max_batch, micro_batches = node.batching  # the plan's batching survives the re-plan
        ring = [self.head, *members]

        async def assign(i: int, address: str, ranges) -> None:
            req = assign_request(ranges, n_layers, model_id, epoch, replan=True, head_address=self.head, ring=ring,
                                 max_batch=max_batch, micro_batches=micro_batches, head_windows=plan.ranges[0],
                                 standby=i == 1, predicted_ms=per_node[i], predicted_tpot_ms=tpot_ms,
                                 buffer_layers=buffers[i])
            async for _ in self._control(address).assign(req):
                pass

        remote = [assign(i, a, r) for i, (a, r) in enumerate(zip(members, plan.ranges[1:]), 1)]
        head = node.assign(Assignment(Windows(plan.ranges[0], n_layers, True), model_id, epoch, replan=True,
                                      buffer_layers=buffers[0], max_batch=max_batch, micro_batches=micro_batches,
                                      predicted=(per_node[0], tpot_ms)), Place(tuple(ring)), lambda *a: None)
        await asyncio.gather(head, *remote)
        node.log.info("ring re-planned", ranges=[list(r) for r in plan.ranges], epoch=epoch)

    # ------------------------------------------------------------------ channels

    def control(self, address: str) -> AioControl:
        """The member's Control service (one channel each, kept)."""
        return self._control(address)

    def _control(self, address: str) -> AioControl:
        if address not in self._peers:
            self._peers[address] = AioControl(address, self.token, DEADLINES)
        return self._peers[address]

    async def _info(self, address: str) -> pb.NodeInfo | None:
        try:
            return await self._control(address).info()
        except grpc.RpcError:
            # A fresh channel next time: a restarted node is seen at once, not after the channel's backoff.
            await self._peers.pop(address).close()
            return None

    async def infos(self) -> list[pb.NodeInfo | None]:
        """Every member's Info now (None: it did not answer), in ring order without the head."""
        return list(await asyncio.gather(*(self._info(a) for a in self.members)))

    def _holds_model(self, info: pb.NodeInfo) -> bool:
        store = self.node.store
        return info.n_layers == store.config.n_layers and info.model_id == store.model_id

    async def close(self) -> None:
        self.closed = True
        peers, self._peers = self._peers, {}
        for peer in peers.values():
            await peer.close()


def _head_of(info: pb.NodeInfo) -> str:
    """The head a node follows: the one its assignment named, itself if it is a head."""
    return info.head or (info.address if info.role == "head" else "")


def _unavailable(message: str) -> RequestFailed:
    return RequestFailed(grpc.StatusCode.UNAVAILABLE, message)


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
