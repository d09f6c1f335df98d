"""The head: what only the ring's first node holds - its requests, their generation loops, replay after a
re-plan, and the watch over its members (nodes/ring/members.py). It uses its node through NodePort only."""

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import torch

from nodes.engine.prefix_cache import NONE
from nodes.errors import PrefixMissed, RequestFailed
from nodes.generation import head_step
from nodes.generation.draft import DraftModel, load_draft
from nodes.generation.reference import ReferenceModel
from nodes.generation.speculate import Speculator
from nodes.generation.state import GenerateParams, Generation, Prefilled, TokenOut
from nodes.jobs import run_job
from nodes.ring import frames
from nodes.ring.admit import KvLedger
from nodes.ring.head_port import NodePort
from nodes.ring.head_requests import HeadRequest, HeadRequests, RingChanged
from nodes.ring.members import Members
from nodes.ring.prefixes import COLD, HeadPrefixes, PrefixPlan
from nodes.ring.replanner import Replanner
from nodes.ring.steps import Stepper
from nodes.ring.work import PREFILL_CHUNK


class Head:
    """Held by the node while it is the ring's head. Uses the node's shard, queues and compute thread."""

    def __init__(self, node: NodePort, ring: list[str], fresh: bool):
        self.node = node
        self.requests = HeadRequests()
        self.members = Members(node, self.requests)
        self.replanner = Replanner(node, self.members, self.requests)  # live re-plans when a device drifts
        self.draft_model: ReferenceModel | None = None
        self.steps = Stepper(node, self.requests)  # the requests' ring steps go out in batches
        self.kv = KvLedger()  # a request the ring's KV budgets cannot hold is refused before it starts
        self.prefixes = HeadPrefixes()  # prompt prefixes the nodes keep the KV of (nodes/ring/prefixes.py)
        self.rewire(ring, fresh)

    def rewire(self, ring: list[str], fresh: bool) -> None:
        """ring: every member's address in ring order, the head's own first. fresh: from prima-ctl."""
        if ring:
            self.members.set_ring(ring[0], ring[1:], fresh)
        if fresh:  # a plan from prima-ctl: what the live re-plan learnt starts over
            self.replanner.reset()

    @property
    def address(self) -> str:
        return self.members.head or self.node.address

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt_ids: list[int], params: GenerateParams, request_id: str,
                       resume: list[int] = ()) -> AsyncIterator[TokenOut | Prefilled | Generation]:
        """Token events of one request (a long prompt's progress before them), then the finished Generation;
        resume: tokens it already gave on a head that was lost (they are replayed, not sent again)."""
        self.requests.check_new(request_id)
        node = self.node
        gen, drafter = await self._generation(prompt_ids, params, resume)
        await self._kv_rooms()
        self.kv.admit(request_id, len(prompt_ids), gen.capacity)
        req = self.requests.add(request_id)
        self.steps.join(request_id)
        plan = COLD
        try:
            await self._ring_ready(req)  # a request that arrives during a re-plan waits for it
            if gen.tokens:  # resumed: its KV caches are rebuilt from the prompt and the tokens it gave
                await self._replay(req, request_id, gen)
            else:
                plan = await self._prefix_plan(prompt_ids)
            while not gen.done:
                ids, pos = gen.pending()
                if not gen.tokens:  # the prompt: from the cached prefix on, if the ring holds one
                    ids, pos = ids[plan.use_len:], plan.use_len
                # Speculation: one trip verifies the drafts, as one multi-position frame.
                draft = await run_job(node.pool, gen.draft) if drafter else gen.draft()
                start = time.perf_counter()
                try:
                    async for done, hidden in self._trip(req, request_id, ids + draft, pos, gen.capacity,
                                                         len(draft) + 1, None if gen.tokens else plan):
                        if hidden is None:  # a prefill chunk of a long prompt went round
                            yield Prefilled(done, len(ids))
                except RingChanged:
                    plan = self._settle(plan, prompt_ids, False)
                    await self._replay(req, request_id, gen)
                    continue
                except PrefixMissed:  # a node lacked the prefix (evicted, restarted): prefill it all
                    node.log.info("prefix not cached on the ring; prefilling from 0", request_id=request_id)
                    plan = self._missed(plan, prompt_ids)
                    continue
                if not gen.tokens:
                    plan = self._settle(plan, prompt_ids, True)
                outs = await head_step.next_tokens(gen, node.pool, node.shard.logits, hidden, draft, req.logits)
                node.stats.last_token_ms = (time.perf_counter() - start) * 1e3 / len(outs)
                for out in outs:
                    yield out
            yield gen
        finally:
            self._settle(plan, prompt_ids, False)
            self.requests.remove(request_id)
            self.kv.release(request_id)
            self.steps.leave(request_id)
            # Free every node's KV cache: the RELEASE frame goes once round the ring. No await here:
            # this also runs when the client's call is cancelled.
            if node.shard is not None:
                node.release(request_id)
            try:
                node.outbox.put_nowait(frames.release(request_id, node.epoch))
            except asyncio.QueueFull:
                node.log.warning("release not sent: outbox full", request_id=request_id)

    async def _kv_rooms(self) -> None:
        """Each node's KV room, asked once an epoch (a member that does not answer: no limit known there)."""
        node = self.node
        if self.kv.epoch == node.epoch:
            return
        infos = await self.members.infos()
        rooms = {a: i.kv_positions for a, i in zip(self.members.members, infos) if i is not None}
        self.kv.rooms = {self.address: node.shard.kv_positions() if node.shard else 0, **rooms}
        self.kv.epoch = node.epoch

    async def _generation(self, prompt_ids: list[int], params: GenerateParams,
                          resume: list[int]) -> tuple[Generation, DraftModel | None]:
        """The request's state (resumed after the tokens it gave; ValueError: INVALID_ARGUMENT) and its drafter."""
        node, drafter = self.node, None
        if params.speculate.mode == "draft" and node.cfg.draft is not None:
            drafter = DraftModel(await self._draft_model())
        gen = Generation(prompt_ids, params, node.text, node.store.manifest.eos_token_ids,
                         node.store.config.max_seq_len, Speculator(params.speculate, drafter), node.store.config.vocab)
        gen.resume(list(resume), node.store.config.vocab)
        return gen, drafter

    async def _prefix_plan(self, prompt_ids: list[int]) -> PrefixPlan:
        """What the prompt takes from and gives to the prefix cache; first it waits for a prefill in flight of the
        same prefix (the n choices of one prompt, agents with one system prompt) so that it is computed once."""
        if self.node.store.config.local_layers:
            return COLD  # sliding-window layers keep a ring of their window: a long prompt's start is not kept
        self.prefixes.renew(self.node.epoch)
        while (sibling := self.prefixes.waits_for(prompt_ids)) is not None:
            try:
                await asyncio.wait_for(asyncio.shield(sibling), self.node.cfg.step_timeout)
            except TimeoutError:
                break
        self.prefixes.fit(self.kv.free())
        return self.prefixes.plan(prompt_ids, self.kv.free())

    def _settle(self, plan: PrefixPlan, prompt_ids: list[int], saved: bool) -> PrefixPlan:
        """The prompt went round (saved) or will not: its prefix is known, its waiters go on; what is left of plan."""
        self.prefixes.settled(plan, prompt_ids, saved)
        return COLD

    def _missed(self, plan: PrefixPlan, prompt_ids: list[int]) -> PrefixPlan:
        """A node lacked the prefix: forget it, and plan again (the full prefill keeps it on every node again)."""
        self._settle(plan, prompt_ids, False)
        self.prefixes.missed(plan.use_key)
        return self.prefixes.plan(prompt_ids, self.kv.free())

    async def _round_trip(self, req: HeadRequest, request_id: str, ids: list[int], pos: int,
                          capacity: int, rows: int = 0) -> torch.Tensor:
        """Hidden states after all layers for tokens at [pos, pos+len(ids)), in prefill chunks, each a step
        that goes round the ring in a batch with the other requests' steps (nodes/ring/steps.py)."""
        steps = [hidden async for _, hidden in self._trip(req, request_id, ids, pos, capacity, rows)]
        return steps[-1]

    async def _trip(self, req: HeadRequest, request_id: str, ids: list[int], pos: int, capacity: int,
                    rows: int = 0, plan: PrefixPlan | None = None) -> AsyncIterator[tuple[int, torch.Tensor | None]]:
        """_round_trip chunk by chunk: (tokens done, None) after each chunk but the last, then (all, hidden);
        plan: the prompt's use of the prefix cache (None: not prompt positions)."""
        timeout = self.node.cfg.step_timeout
        loop = asyncio.get_running_loop()
        for offset in range(0, len(ids), PREFILL_CHUNK):
            if req.failure:
                raise req.failure
            req.waiter, req.logits = loop.create_future(), None
            req.rows = rows if offset + PREFILL_CHUNK >= len(ids) else 0
            try:
                chunk = ids[offset:offset + PREFILL_CHUNK]
                prefix = NONE if plan is None else plan.chunk(pos + offset, len(chunk), use=offset == 0)
                # asyncio.timeout, not wait_for: Python 3.11's wait_for wraps the send in a task of its own, a
                # loop turn on every token's path.
                async with asyncio.timeout(timeout):
                    await self.steps.send(request_id, chunk, pos + offset, capacity, prefix)
                async with asyncio.timeout(timeout):
                    hidden = await req.waiter
            except TimeoutError:
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                    f"no answer from the ring within {timeout:.0f} s (a node may be down)") from None
            finally:
                self.steps.back(request_id)
            done = min(offset + PREFILL_CHUNK, len(ids))
            yield done, hidden if done == len(ids) else None

    async def _draft_model(self) -> ReferenceModel:
        """The head's draft model, loaded on first use (prima-node --draft DIR); shared by its requests."""
        if self.draft_model is None:
            self.draft_model = await asyncio.get_running_loop().run_in_executor(
                self.node.pool, load_draft, self.node.cfg.draft, self.node.text)  # Rejected: the node stays up
        return self.draft_model

    async def _ring_ready(self, req: HeadRequest) -> None:
        try:
            await asyncio.wait_for(self.requests.ring_ready.wait(), self.node.cfg.step_timeout)
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

    async def deliver_batch(self, results: list[tuple[str, torch.Tensor]]) -> None:
        """A batch's hidden states after all layers; the logits of its plain steps in one projection (one pass
        over the output matrix for the batch). Verify frames project their rows one by one in their own loop,
        as a plain step would."""
        reqs = [(self.requests.get(rid), h) for rid, h in results]
        plain = [(r, h) for r, h in reqs if r is not None and r.rows == 1]
        if len(plain) > 1:  # alone, the request projects its own row as before
            logits = await run_job(self.node.pool, self.node.shard.last_logits, [h for _, h in plain])
            for (r, _), row in zip(plain, logits, strict=True):
                r.logits = row
        for r, h in reqs:
            if r is not None:
                r.deliver(h)

    async def close(self) -> None:
        """No longer the head (re-assigned as a member, stopped): its requests end, so their clients resume."""
        gone = RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{self.node.cfg.name or self.node.address} is no longer "
                                                          "the ring's head")
        self.requests.end(gone)
        self.steps.close(self.requests.ended)  # the first reason given: a step-down's names the new head
        await self.members.close()
