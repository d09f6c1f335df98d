"""The head: what only the ring's first node holds - its requests, their generation loops, replay after a
re-plan, and the watch over its members (nodes/ring/members.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from nodes.errors import Rejected, RequestCancelled, RequestFailed
from nodes.generation.draft import DraftModel, load_draft
from nodes.generation.reference import ReferenceModel
from nodes.generation.speculate import Speculator
from nodes.generation.state import GenerateParams, Generation, TokenOut
from nodes.ring import frames
from nodes.ring.members import Members
from nodes.ring.steps import Stepper
from nodes.ring.work import MAX_REQUESTS, PREFILL_CHUNK

if TYPE_CHECKING:
    from nodes.ring.node import Node


class RingChanged(Exception):
    """The ring was re-planned while this request waited: replay it on the new ring."""


@dataclass
class HeadRequest:
    """The head's side of one request: the hidden state or failure the ring hands back."""

    waiter: asyncio.Future | None = None
    failure: RequestFailed | None = None
    rows: int = 0  # logit rows its step wants: 1 for a plain step (computed with the batch's), else its own
    logits: torch.Tensor | None = None  # [V] of the last step, when computed with its batch's

    def deliver(self, hidden: torch.Tensor) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(hidden)

    def fail(self, failure: RequestFailed) -> None:
        self.failure = self.failure or failure
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(failure)

    def ring_changed(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(RingChanged())


class Head:
    """Held by the node while it is the ring's head. Uses the node's shard, queues and compute thread."""

    def __init__(self, node: Node, ring: list[str], fresh: bool):
        self.node = node
        self.requests: dict[str, HeadRequest] = {}
        self.ring_ready = asyncio.Event()  # cleared while the ring is re-planned
        self.ring_ready.set()
        self.members = Members(self, node.cfg.token)
        self.draft_model: ReferenceModel | None = None
        self.steps = Stepper(self)  # the requests' ring steps go out in batches
        self.rewire(ring, fresh)

    def rewire(self, ring: list[str], fresh: bool) -> None:
        """ring: every member's address in ring order, the head's own first. fresh: from prima-ctl."""
        if ring:
            self.members.set_ring(ring[0], ring[1:], fresh)

    @property
    def address(self) -> str:
        return self.members.head or self.node.address

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt_ids: list[int], params: GenerateParams,
                       request_id: str) -> AsyncIterator[TokenOut | Generation]:
        """Token events of one request, then the finished Generation itself."""
        if len(self.requests) >= MAX_REQUESTS:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the head serves at most {MAX_REQUESTS} requests")
        if request_id in self.requests:
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is in use")
        node = self.node
        drafter = None
        if params.speculate.mode == "draft" and node.cfg.draft is not None:
            drafter = DraftModel(await self._draft_model())
        gen = Generation(prompt_ids, params, node.text, node.store.manifest.eos_token_ids,
                         node.store.config.max_seq_len, Speculator(params.speculate, drafter))
        req = self.requests[request_id] = HeadRequest()
        self.steps.join(request_id)
        try:
            await self._ring_ready(req)  # a request that arrives during a re-plan waits for it
            while not gen.done:
                ids, pos = gen.pending()
                # Speculation: one trip verifies the drafts, as one multi-position frame.
                draft = await asyncio.get_running_loop().run_in_executor(node.pool, gen.draft) \
                    if drafter else gen.draft()
                start = time.perf_counter()
                try:
                    hidden = await self._round_trip(req, request_id, ids + draft, pos, gen.capacity, len(draft) + 1)
                except RingChanged:
                    await self._replay(req, request_id, gen)
                    continue
                loop = asyncio.get_running_loop()
                if draft:
                    logits = await loop.run_in_executor(node.pool, _row_logits, node.shard, hidden, len(draft) + 1)
                    outs = gen.accept_draft(logits, draft)
                else:
                    logits = req.logits if req.logits is not None else \
                        await loop.run_in_executor(node.pool, node.shard.logits, hidden)
                    outs = [gen.accept(logits)]
                node.stats.last_token_ms = (time.perf_counter() - start) * 1e3 / len(outs)
                for out in outs:
                    yield out
            yield gen
        finally:
            del self.requests[request_id]
            self.steps.leave(request_id)
            # Free every node's KV cache: the RELEASE frame goes once round the ring. No await here:
            # this also runs when the client's call is cancelled.
            if node.shard is not None:
                node.release(request_id)
            try:
                node.outbox.put_nowait(frames.release(request_id, node.epoch))
            except asyncio.QueueFull:
                node.log.warning("release not sent: outbox full", request_id=request_id)

    async def _round_trip(self, req: HeadRequest, request_id: str, ids: list[int], pos: int,
                          capacity: int, rows: int = 0) -> torch.Tensor:
        """Hidden states after all layers for tokens at [pos, pos+len(ids)), in prefill chunks, each a step
        that goes round the ring in a batch with the other requests' steps (nodes/ring/steps.py)."""
        node = self.node
        loop = asyncio.get_running_loop()
        for offset in range(0, len(ids), PREFILL_CHUNK):
            if req.failure:
                raise req.failure
            req.waiter, req.logits = loop.create_future(), None
            req.rows = rows if offset + PREFILL_CHUNK >= len(ids) else 0
            try:
                await self.steps.send(request_id, ids[offset:offset + PREFILL_CHUNK], pos + offset, capacity)
                hidden = await asyncio.wait_for(req.waiter, node.cfg.step_timeout)
            except TimeoutError:
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                    f"no answer from the ring within {node.cfg.step_timeout:.0f} s "
                                    "(a node may be down)") from None
            finally:
                self.steps.back(request_id)
        return hidden

    async def _draft_model(self) -> ReferenceModel:
        """The head's draft model, loaded on first use (prima-node --draft DIR); shared by its requests."""
        if self.draft_model is None:
            self.draft_model = await asyncio.get_running_loop().run_in_executor(
                self.node.pool, load_draft, self.node.cfg.draft, self.node.text)  # Rejected: the node stays up
        return self.draft_model

    async def _ring_ready(self, req: HeadRequest) -> None:
        try:
            await asyncio.wait_for(self.ring_ready.wait(), self.node.cfg.step_timeout)
        except TimeoutError:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the ring did not recover in time") from None
        if req.failure:
            raise req.failure
        if self.node.shard is None:  # a re-plan failed and left the head without layers
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                f"the ring has no working assignment ({self.node.last_error or 'see the head log'}); "
                                "restart the lost node or run prima-ctl start")

    async def _replay(self, req: HeadRequest, request_id: str, gen: Generation) -> None:
        """After a re-plan: rebuild this request's KV caches on the new ring from its tokens so far."""
        while True:
            await self._ring_ready(req)
            history = gen.prompt_ids + gen.tokens[:-1] if gen.tokens else []
            self.node.log.info("replaying request on the new ring", request_id=request_id, tokens=len(history))
            try:
                if history:
                    await self._round_trip(req, request_id, history, 0, gen.capacity)
                return
            except RingChanged:
                continue

    def known(self, request_id: str) -> bool:
        return request_id in self.requests

    def deliver(self, request_id: str, hidden: torch.Tensor) -> None:
        if (req := self.requests.get(request_id)) is not None:
            req.deliver(hidden)

    async def deliver_batch(self, results: list[tuple[str, torch.Tensor]]) -> None:
        """A batch's hidden states after all layers; the logits of its plain steps in one projection (one pass
        over the output matrix for the batch). Verify frames project their rows one by one in their own loop,
        as a plain step would."""
        reqs = [(self.requests.get(rid), h) for rid, h in results]
        plain = [(r, h) for r, h in reqs if r is not None and r.rows == 1]
        if len(plain) > 1:  # alone, the request projects its own row as before
            logits = await asyncio.get_running_loop().run_in_executor(
                self.node.pool, self.node.shard.last_logits, [h for _, h in plain])
            for (r, _), row in zip(plain, logits, strict=True):
                r.logits = row
        for r, h in reqs:
            if r is not None:
                r.deliver(h)

    def fail(self, request_id: str, failure: RequestFailed) -> None:
        if (req := self.requests.get(request_id)) is not None:
            req.fail(failure)

    def fail_all(self, failure: RequestFailed) -> None:
        for req in self.requests.values():
            req.fail(failure)

    def ring_changed(self) -> None:
        for req in self.requests.values():
            req.ring_changed()

    def cancel(self, request_id: str) -> bool:
        if request_id not in self.requests:
            return False
        self.fail(request_id, RequestCancelled())
        return True

    async def close(self) -> None:
        self.steps.close()
        await self.members.close()


def _row_logits(shard, hidden: torch.Tensor, rows: int) -> torch.Tensor:
    """Logits [rows, V] of the last `rows` positions, each projected alone exactly as a plain step projects it."""
    t = hidden.shape[0]
    return torch.stack([shard.logits(hidden[:i + 1]) for i in range(t - rows, t)])
