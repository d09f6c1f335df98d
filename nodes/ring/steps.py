"""The head's step scheduler (continuous batching): the steps of its requests go round the ring together.

Each request's generation loop stays its own coroutine; when its next step is ready (a decode token, a verify
frame with drafts, or a prefill chunk of at most PREFILL_CHUNK tokens) it hands it here. A batch is sent when
every request at the head has handed in its step, or once none has handed in or come back for STEP_GAP_S, and
at most STEP_WAIT_S after the first was handed in (or after a slot in the ring freed, for steps that waited
for one), so that one slow request (a draft model, say) does not hold the others long. A batch goes as one
embedding and frames sent back to back (batch_rest), up to the node's max batch. At most `micro_batches`
batches are in the ring at once; a request that arrives meanwhile joins the next batch, so a new prompt delays
the others' decode by at most one chunk per step.
"""

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from nodes.engine.prefix_cache import NONE, Prefix
from nodes.generation import head_step
from nodes.ring import frames
from nodes.ring.head_port import NodePort
from nodes.ring.head_requests import HeadRequests, RingChanged
from nodes.ring.work import Work
from prima_rpc.spec.windows import Step
from prima_rpc.v1 import prima_pb2 as pb

STEP_GAP_S = 0.05
STEP_WAIT_S = 0.25


@dataclass
class _Step:
    request_id: str
    ids: list[int]
    pos: int
    capacity: int
    sent: asyncio.Future
    since: float
    prefix: Prefix = NONE
    window: int = 0  # the request's step number, and the lowest of its steps not cancelled (Frame)
    live_from: int = 0


class Stepper:
    def __init__(self, node: NodePort, requests: HeadRequests):
        self.node, self.requests = node, requests
        self.at_head: set[str] = set()  # requests computing at the head (logits, sampling, drafts)
        self.ready: list[_Step] = []
        # request id -> its steps' batches in the ring, oldest first: each its count of requests still in the ring
        self.in_ring: dict[str, deque[list[int]]] = {}
        self.batches = 0  # batches in the ring
        self.last_in = 0.0  # when the latest step was handed in or came back
        self.freed = 0.0  # when a batch last came back whole (a slot in the ring freed)
        self.kick = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.sending: list[_Step] = []  # the batch the scheduler is sending now

    def join(self, request_id: str) -> None:
        self.at_head.add(request_id)

    def leave(self, request_id: str) -> None:
        self.drop(request_id)
        self.at_head.discard(request_id)
        self.ready = [s for s in self.ready if s.request_id != request_id]
        self.kick.set()

    def drop(self, request_id: str) -> None:
        """None of the request's steps in the ring will come back (it failed, the ring changed)."""
        while request_id in self.in_ring:
            self.back(request_id)

    def back(self, request_id: str) -> None:
        """The request's oldest step in the ring came back: it is at the head again (verifying, drafting)."""
        cells = self.in_ring.get(request_id)
        if cells:
            cell = cells.popleft()
            if not cells:
                del self.in_ring[request_id]
            cell[0] -= 1
            if cell[0] == 0:
                self.batches -= 1
                self.freed = time.perf_counter()
            self.at_head.add(request_id)
            self.last_in = time.perf_counter()
            self.kick.set()

    async def send(self, request_id: str, ids: list[int], pos: int, capacity: int, prefix: Prefix = NONE,
                   ahead: bool = False, window: int = 0, live_from: int = 0) -> None:
        """Queue a step of `ids` at positions [pos, pos + len(ids)); returns once it is in the ring. ahead: a
        speculative window sent while the request's earlier ones are still in the ring; it goes at once, alone,
        whatever the batches in flight (its request's own window is one of them)."""
        loop = asyncio.get_running_loop()
        step = _Step(request_id, ids, pos, capacity, loop.create_future(), time.perf_counter(), prefix, window,
                     live_from)
        if ahead:
            try:
                await self._send([step])
            except Exception as exc:
                _settle([step], exc)
            return await step.sent
        if self.task is None or self.task.done():
            self.task = loop.create_task(self._run(), name="head-steps")
        self.last_in = step.since
        self.at_head.discard(request_id)
        self.ready.append(step)
        self.kick.set()
        await step.sent

    async def _run(self) -> None:
        while True:
            await self.kick.wait()
            self.kick.clear()
            while self.ready and self.batches < self.node.micro_batches:
                limit = self.node.max_batch
                now = time.perf_counter()
                # Steps that waited for a slot in the ring wait no longer than fresh ones: the cap counts from
                # when they could go, else two groups that split once would stay split for good.
                since = max(self.ready[0].since, self.freed)
                left = min(STEP_WAIT_S - (now - since), STEP_GAP_S - (now - self.last_in))
                if self.at_head and len(self.ready) < limit and left > 0:  # others are about to hand in theirs
                    try:
                        await asyncio.wait_for(self.kick.wait(), left)
                    except TimeoutError:
                        pass
                    self.kick.clear()
                    continue
                batch, self.ready = self.ready[:limit], self.ready[limit:]
                self.sending = batch
                try:
                    await self._send(batch)
                except Exception as exc:  # its requests fail with it; the scheduler goes on for the others
                    _settle(batch, exc)
                self.sending = []

    async def _send(self, batch: list[_Step]) -> None:
        requests, node = self.requests, self.node
        batch = [s for s in batch if not s.sent.done()]
        if not batch:
            return
        if not requests.ring_ready.is_set() or node.shard is None:  # a re-plan began: these steps' epoch is over
            return _settle(batch, RingChanged())
        try:
            x = await head_step.embed(node.pool, node.shard.embed, [i for s in batch for i in s.ids])
        except Exception as exc:
            return _settle(batch, exc)
        go = []
        for s, h in zip(batch, x.split([len(s.ids) for s in batch]), strict=True):
            req = requests.get(s.request_id)
            if s.sent.done() or req is None:
                continue
            if req.failure:
                s.sent.set_exception(req.failure)
            elif not requests.ring_ready.is_set():  # a re-plan began while embedding
                s.sent.set_exception(RingChanged())
            else:
                go.append((s, h))
        if not go:
            return
        cell = [len(go)]
        self.batches += 1
        for s, _ in go:
            self.in_ring.setdefault(s.request_id, deque()).append(cell)
        # A head whose windows do not begin at layer 0 only passes the embedding on: straight to the successor,
        # not through its own compute loop (a loop turn on every token's path).
        passes = node.windows is not None and node.windows.step(0) is Step.FORWARD
        for i, (s, h) in enumerate(go):
            w = Work(s.request_id, pb.FORWARD, s.pos, 0, s.capacity, h, epoch=node.epoch, batch_rest=len(go) - 1 - i,
                     prefix=s.prefix, window=s.window, live_from=s.live_from)
            await (node.outbox.put(frames.forward(w, w.batch_rest)) if passes else node.inbox.put(w))
        _settle([s for s, _ in go], None)

    def close(self, failure: BaseException) -> None:
        """Stop sending: every step not yet in the ring ends with `failure` (a step the cancelled scheduler was
        sending, or still to send, would otherwise leave its request waiting for good: a head that stepped down
        as a request came in hung its client)."""
        if self.task is not None:
            self.task.cancel()
        _settle(self.sending + self.ready, failure)
        self.sending, self.ready = [], []


def _settle(steps: list[_Step], exc: BaseException | None) -> None:
    for s in steps:
        if not s.sent.done():
            if exc is None:
                s.sent.set_result(None)
            else:
                s.sent.set_exception(exc)
