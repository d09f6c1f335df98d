"""The head's side of a request: its generation loop, ring round trips, and replay after a re-plan."""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from nodes.generation import GenerateParams, Generation, TokenOut
from nodes.work import MAX_REQUESTS, PREFILL_CHUNK, Rejected, Work
from prima_rpc.v1 import prima_pb2 as pb


class RequestFailed(Exception):
    """A ring node reported an error for this request."""


class RingChanged(Exception):
    """The ring was re-planned while this request waited: replay it on the new ring."""


@dataclass
class HeadRequest:
    """The head's side of one request: the hidden state or error the ring hands back."""

    waiter: asyncio.Future | None = None
    error: str | None = None
    cancelled: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def deliver(self, hidden: torch.Tensor) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(hidden)

    def fail(self, message: str) -> None:
        self.error = message
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(RequestFailed(message))

    def ring_changed(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(RingChanged())


class HeadRole:
    """Mixed into Node: what only the head does. Uses the node's queues, shard, pool and store."""


    async def generate(self, prompt_ids: list[int], params: GenerateParams,
                       request_id: str) -> AsyncIterator[TokenOut | Generation]:
        """Token events of one request, then the finished Generation itself."""
        if self.role != "head":
            raise Rejected("FAILED_PRECONDITION", f"this node is a {self.role}, not the ring's head")
        if len(self.requests) >= MAX_REQUESTS:
            raise Rejected("RESOURCE_EXHAUSTED", f"the head serves at most {MAX_REQUESTS} requests at once")
        if request_id in self.requests:
            raise Rejected("ALREADY_EXISTS", f"request id {request_id!r} is in use")
        cfg = self.store.config
        gen = Generation(prompt_ids, params, self.text, self.store.manifest.eos_token_ids, cfg.max_seq_len)
        req = self.requests[request_id] = HeadRequest()
        try:
            while not gen.done:
                ids, pos = gen.pending()
                start = time.perf_counter()
                try:
                    hidden = await self._round_trip(req, request_id, ids, pos, gen.capacity)
                except RingChanged:
                    await self._replay(req, request_id, gen)
                    continue
                logits = await asyncio.get_running_loop().run_in_executor(self.pool, self.shard.logits, hidden)
                self.stats.last_token_ms = (time.perf_counter() - start) * 1e3
                yield gen.accept(logits)
            yield gen
        finally:
            del self.requests[request_id]
            # Free every node's KV cache: the RELEASE frame goes once round the ring. No await here:
            # this also runs when the client's call is cancelled.
            if self.shard is not None:
                self._release(request_id)
            try:
                self.outbox.put_nowait(pb.Frame(request_id=request_id, kind=pb.RELEASE, epoch=self.epoch))
            except asyncio.QueueFull:
                self.log.warning("release not sent: outbox full", request_id=request_id)

    async def _round_trip(self, req: HeadRequest, request_id: str, ids: list[int], pos: int,
                          capacity: int) -> torch.Tensor:
        """Hidden states after all layers for tokens at [pos, pos+len(ids)), in prefill chunks."""
        loop = asyncio.get_running_loop()
        for offset in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[offset:offset + PREFILL_CHUNK]
            x = await loop.run_in_executor(self.pool, self.shard.embed, chunk)
            req.waiter = loop.create_future()
            await self.inbox.put(Work(request_id, pb.FORWARD, pos + offset, 0, capacity, x, epoch=self.epoch))
            try:
                hidden = await asyncio.wait_for(req.waiter, self.cfg.step_timeout)
            except TimeoutError:
                raise RequestFailed(f"no answer from the ring within {self.cfg.step_timeout:.0f} s "
                                    "(a node may be down)") from None
        return hidden

    async def _replay(self, req: HeadRequest, request_id: str, gen: Generation) -> None:
        """After a re-plan: rebuild this request's KV caches on the new ring from its tokens so far."""
        while True:
            try:
                await asyncio.wait_for(self.ring_ready.wait(), self.cfg.step_timeout)
            except TimeoutError:
                raise RequestFailed("the ring did not recover in time") from None
            if req.error:
                raise RequestFailed(req.error)
            history = gen.prompt_ids + gen.tokens[:-1] if gen.tokens else []
            self.log.info("replaying request on the new ring", request_id=request_id, tokens=len(history))
            try:
                if history:
                    await self._round_trip(req, request_id, history, 0, gen.capacity)
                return
            except RingChanged:
                continue

    def cancel(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.fail("cancelled")
        return True
