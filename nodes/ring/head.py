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
from nodes.generation.draft import DraftModel, load_draft, vocab_fingerprint
from nodes.generation.reference import ReferenceModel
from nodes.generation.speculate import DEFAULT_MODE, Speculator
from nodes.generation.state import GenerateParams, Generation, Prefilled, TokenOut
from nodes.jobs import run_job
from nodes.ring import frames
from nodes.ring.admit import KvLedger
from nodes.ring.drafts import RemoteDrafter
from nodes.ring.head_port import NodePort
from nodes.ring.head_requests import HeadRequest, HeadRequests, RingChanged, Window
from nodes.ring.inflight import ahead, decode_ahead, draft_for
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
        self.vocab: str | None = None  # the target's tokenizer fingerprint, which a member's draft must share
        self.member_drafts = False  # a member was started with --draft (as of the latest Info of them all)
        self.steps = Stepper(node, self.requests)  # the requests' ring steps go out in batches
        self.requests.returned = self.steps.back
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
        gen = await self._generation(prompt_ids, params, resume, request_id)
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
                if gen.tokens and ahead(gen):  # decode with windows in flight (nodes/ring/inflight.py)
                    try:
                        async for out in decode_ahead(self, req, request_id, gen):
                            yield out
                    except RingChanged:
                        await self._replay(req, request_id, gen)
                    continue
                ids, pos = gen.pending()
                if not gen.tokens:  # the prompt: from the cached prefix on, if the ring holds one
                    ids, pos = ids[plan.use_len:], plan.use_len
                # Speculation: one trip verifies the drafts, as one multi-position frame.
                draft = await draft_for(self, gen)
                start = time.perf_counter()
                gen.trips += 1
                try:
                    async for step in self._trip(req, request_id, ids + draft, pos, gen.capacity, len(draft) + 1,
                                                 None if gen.tokens else plan):
                        done, hidden, logits = step
                        if hidden is None:  # a prefill chunk of a long prompt went round
                            yield Prefilled(done, len(ids))
                except RingChanged:
                    plan = self._settle(plan, prompt_ids, False)
                    await self._replay(req, request_id, gen)
                    continue
                except PrefixMissed:  # a node lacked the prefix or the request's KV cache (evicted, restarted)
                    plan = self._missed(plan, prompt_ids)
                    if gen.tokens:  # past the prompt: every node's cache is rebuilt from the prompt and the tokens
                        node.log.info("a node lost the request's KV cache; replaying it", request_id=request_id)
                        await self._replay(req, request_id, gen)
                    else:
                        node.log.info("prefix not cached on the ring; prefilling from 0", request_id=request_id)
                    continue
                if not gen.tokens:
                    plan = self._settle(plan, prompt_ids, True)
                outs = await head_step.next_tokens(gen, node.pool, node.shard.logits, hidden, draft, logits)
                node.stats.last_token_ms = (time.perf_counter() - start) * 1e3 / len(outs)
                for out in outs:
                    yield out
            yield gen
        finally:
            self._end(plan, prompt_ids, request_id)

    def _end(self, plan, prompt_ids: list[int], request_id: str) -> None:
        """A request is over (done, failed or cancelled): its records here go, and every node's KV cache with the
        RELEASE frame, once round the ring. No await: this also runs when the client's call is cancelled."""
        node = self.node
        self._settle(plan, prompt_ids, False)
        self.requests.remove(request_id)
        self.kv.release(request_id)
        self.steps.leave(request_id)
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
        self.member_drafts = any(i is not None and i.draft for i in infos)
        self.kv.rooms = {self.address: node.shard.kv_positions() if node.shard else 0, **rooms}
        self.kv.epoch = node.epoch

    async def _generation(self, prompt_ids: list[int], params: GenerateParams, resume: list[int],
                          request_id: str) -> Generation:
        """The request's state (resumed after the tokens it gave; ValueError: INVALID_ARGUMENT) with its drafter:
        the head's draft model (prima-node --draft), else a member's (a relay started with --draft)."""
        node, drafter = self.node, None
        if params.speculate.mode == "draft" and node.cfg.draft is not None:
            drafter = DraftModel(await self._draft_model())
        elif params.speculate.mode == "draft":
            drafter = await self._member_drafter(request_id)
        gen = Generation(prompt_ids, params, node.text, node.store.manifest.eos_token_ids,
                         node.store.config.max_seq_len, Speculator(params.speculate, drafter), node.store.config.vocab)
        gen.resume(list(resume), node.store.config.vocab)
        return gen

    async def _member_drafter(self, request_id: str) -> RemoteDrafter | None:
        """A drafter on the first member started with --draft (None: no member has one)."""
        for address, info in zip(self.members.members, await self.members.infos()):
            if info is not None and info.draft:
                if self.vocab is None:
                    self.vocab = await run_job(self.node.pool, vocab_fingerprint, self.node.text)
                return RemoteDrafter(self.members.control(address), request_id, self.vocab)
        return None

    def default_speculate(self) -> str:
        """The drafter of a request that does not say: a draft model where the ring has one (the head's, or a
        member's as of its latest Info), else prompt lookup. Measured on SmolLM2 (docs/speculation.md): its int4
        copy drafting for the float32 target is accepted 94-100 % on chat, code and story prompts, where prompt
        lookup drafts a few tokens in 32 and keeps a third of them; who starts a node with --draft wants it used."""
        return "draft" if self.node.cfg.draft is not None or self.member_drafts else DEFAULT_MODE

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
        return self.prefixes.plan(prompt_ids, self.kv.free(), self._on_disk)

    def _on_disk(self, key: str) -> bool:
        """This node's disk holds prefix `key` of its windows (nodes/engine/prefix_disk.py)."""
        shard = self.node.shard
        return shard is not None and shard.disk is not None and shard.disk.has(shard.windows.ranges, key)

    def _settle(self, plan: PrefixPlan, prompt_ids: list[int], saved: bool) -> PrefixPlan:
        """The prompt went round (saved) or will not: its prefix is known, its waiters go on; what is left of plan."""
        self.prefixes.settled(plan, prompt_ids, saved)
        return COLD

    def _missed(self, plan: PrefixPlan, prompt_ids: list[int]) -> PrefixPlan:
        """A node lacked the prefix: forget it, and plan again (the full prefill keeps it on every node again)."""
        self._settle(plan, prompt_ids, False)
        self.prefixes.missed(plan.use_key)
        return self.prefixes.plan(prompt_ids, self.kv.free(), self._on_disk)

    async def _round_trip(self, req: HeadRequest, request_id: str, ids: list[int], pos: int,
                          capacity: int, rows: int = 0) -> torch.Tensor:
        """Hidden states after all layers for tokens at [pos, pos+len(ids)), in prefill chunks, each a step
        that goes round the ring in a batch with the other requests' steps (nodes/ring/steps.py)."""
        steps = [hidden async for _, hidden, _ in self._trip(req, request_id, ids, pos, capacity, rows)]
        return steps[-1]

    async def _trip(self, req: HeadRequest, request_id: str, ids: list[int], pos: int, capacity: int,
                    rows: int = 0, plan: PrefixPlan | None = None
                    ) -> AsyncIterator[tuple[int, torch.Tensor | None, torch.Tensor | None]]:
        """_round_trip chunk by chunk: (tokens done, None, None) after each chunk but the last, then (all, hidden,
        logits [V] of a plain step computed with its batch's, else None); plan: the prompt's use of the prefix
        cache (None: not prompt positions)."""
        for offset in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[offset:offset + PREFILL_CHUNK]
            prefix = NONE if plan is None else plan.chunk(pos + offset, len(chunk), use=offset == 0)
            window = await self.send_window(req, request_id, chunk, pos + offset, capacity,
                                            rows if offset + PREFILL_CHUNK >= len(ids) else 0, prefix)
            hidden = await self.answer(req, request_id, window)
            done = min(offset + PREFILL_CHUNK, len(ids))
            yield done, hidden if done == len(ids) else None, window.logits

    async def send_window(self, req: HeadRequest, request_id: str, ids: list[int], pos: int, capacity: int,
                          rows: int, prefix=NONE) -> Window:
        """A step of `ids` at [pos, pos + len(ids)) into the ring; a request with steps in the ring already
        (windows in flight) sends it at once, behind them."""
        if req.failure:
            raise req.failure
        window = req.expect(asyncio.get_running_loop().create_future(), rows)
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for wraps the send in a task of its own, a
            # loop turn on every token's path.
            async with asyncio.timeout(self.node.cfg.step_timeout):
                await self.steps.send(request_id, ids, pos, capacity, prefix, ahead=len(req.windows) > 1,
                                      window=window.number, live_from=req.live_from)
        except BaseException as exc:
            self._abandon(req, request_id)
            if isinstance(exc, TimeoutError):
                raise self._no_answer() from None
            raise
        return window

    async def answer(self, req: HeadRequest, request_id: str, window: Window) -> torch.Tensor:
        """The hidden states [T, H] after all layers of a step sent."""
        try:
            async with asyncio.timeout(self.node.cfg.step_timeout):
                return await window.waiter
        except BaseException as exc:
            self._abandon(req, request_id)
            if isinstance(exc, TimeoutError):
                raise self._no_answer() from None
            raise

    def _abandon(self, req: HeadRequest, request_id: str) -> None:
        """None of the request's steps in the ring is waited for any more."""
        req.abandon()
        self.steps.drop(request_id)

    def _no_answer(self) -> RequestFailed:
        return RequestFailed(grpc.StatusCode.UNAVAILABLE,
                             f"no answer from the ring within {self.node.cfg.step_timeout:.0f} s (a node may be down)")

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

    async def deliver_batch(self, results: list[tuple[str, torch.Tensor, int]]) -> None:
        """A batch's hidden states after all layers; the logits of its plain steps in one projection (one pass
        over the output matrix for the batch). Verify frames project their rows one by one in their own loop,
        as a plain step would."""
        reqs = [(self.requests.get(rid), h) for rid, h, _ in results]
        plain = [(r.front, h) for r, h in reqs if r is not None and r.front is not None and r.front.rows == 1]
        if len(plain) > 1:  # alone, the request projects its own row as before
            logits = await run_job(self.node.pool, self.node.shard.last_logits, [h for _, h in plain])
            for (w, _), row in zip(plain, logits, strict=True):
                w.logits = row
        for rid, h, number in results:
            self.requests.deliver(rid, h, number)

    async def close(self, why: str = "") -> None:
        """No longer the head (re-assigned as a member, handed over, stepped down, stopped): its requests end
        UNAVAILABLE, `why` (else that it is no longer the head) their reason, so their clients resume."""
        why = why or f"{self.node.cfg.name or self.node.address} is no longer the ring's head"
        self.requests.end(RequestFailed(grpc.StatusCode.UNAVAILABLE, why))
        self.steps.close(self.requests.ended)  # the first reason given: a step-down's names the new head
        await self.members.close()
