"""The node actor: frames in, windows computed on one compute thread, frames out to the successor.

State plus three named coroutines (`run`): the Ring service validates frames into `inbox`; "compute"
runs them, the frames waiting for the same layers together as one batch (torch work off the event loop on a
single thread); "send" writes `outbox` to the successor;
"watch" lets the head (only the head node holds a `Head`) probe its members. Every request has at most
one frame in flight, so queues longer than the request limit cannot deadlock the ring. What needs no node
state lives beside it: the frame checks (admit.py), the batch decisions (batching.py), where an assignment's
weights come from (weights.py).
"""

import asyncio
import time
import uuid
from dataclasses import replace

import grpc
import structlog
import torch

from nodes.engine import heap
from nodes.engine.dtype_choice import compute_dtype
from nodes.engine.model import KVCache
from nodes.engine.shard import Shard, check_assignment
from nodes.engine.store import LayerStore
from nodes.errors import Rejected, RequestFailed
from nodes.generation.text import TextCodec
from nodes.jobs import run_job
from nodes.ring import admit, batching, frames, loops, node_info, owner, weights
from nodes.ring.assignment import Assignment, Place
from nodes.ring.compute_pool import ComputePool
from nodes.ring.config import NodeConfig, Stats
from nodes.ring.drafts import DraftServer
from nodes.ring.head import Head
from nodes.ring.head_watch import HeadWatch
from nodes.ring.inbox import Inbox
from nodes.ring.link import RingLink
from nodes.ring.shard_load import new_shard
from nodes.ring.spans import Spans
from nodes.ring.standby import Standby
from nodes.ring.work import CACHE_IDLE_S, MAX_CACHES, QUEUE, Work
from prima_rpc.spec.windows import Step, Windows
from prima_rpc.v1 import prima_pb2 as pb

log = structlog.get_logger()
Code = grpc.StatusCode


class Node:
    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.node_id = uuid.uuid4().hex
        self.address = f"{cfg.host}:{cfg.port}"
        self.store = LayerStore(cfg.model) if cfg.model else None
        self.windows: Windows | None = None
        self.shard: Shard | None = None
        self.text: TextCodec | None = None
        self.head: Head | None = None  # only while this node is the ring's head
        self.head_address = ""  # the ring's head, as the ring dials it (for status)
        self.fetching = False  # fetching or loading windows
        self.fetched_bytes = 0  # store bytes fetched from other nodes
        self.cached_units = weights.count_units(self.store)
        self.last_error = ""
        self.peer = cfg.peer
        self.epoch = 0  # frames of another epoch (an older ring) are dropped
        self.inbox: Inbox = Inbox(QUEUE)
        self.outbox: asyncio.Queue[pb.Frame] = asyncio.Queue(QUEUE)
        self.link = RingLink(cfg.peer, cfg.token)
        self.spans = Spans()  # the hot path's time by part (nodes/ring/spans.py), read by the metrics
        self.pool = ComputePool(self.spans, cfg.inline_s)  # one compute thread; short jobs on the loop
        self.cache_used: dict[str, float] = {}  # request id -> when its KV cache was last used
        self.stats = Stats()
        self.predicted = (0.0, 0.0)  # the applied plan's (ms per token here, ring TPOT ms); Info reports it
        self.log = log.bind(node=cfg.name or self.address)
        self.max_batch = cfg.max_batch  # frames one compute takes (the assignment's, else the node's default)
        self.micro_batches = 1  # head: batches of requests in flight round the ring
        self.batching = (0, 0)
        self.standby = Standby(cfg.cache, cfg.token)  # the head's units on this disk, should the head be lost
        self.drafts = DraftServer(cfg.draft) if cfg.draft is not None else None  # --draft: drafts for the head
        self.head_watch = HeadWatch(self)
        self.memory_cap = 0  # bytes: what this node kept after giving memory back to its owner (0: none given)
        self.memory_low = False  # it gave memory back and waits for the head's re-plan (its next load is smaller)
        self.memory_watch = owner.MemoryWatch(self)

    # ------------------------------------------------------------------ roles and loading

    @property
    def role(self) -> str:
        if self.windows is None:
            return "idle"
        return "head" if self.windows.head else "relay" if self.windows.relay else "worker"

    async def assign(self, job: Assignment, place: Place, progress) -> None:
        """Load the layers of `job` (off the loop), reporting progress(done, total, unit), and take its role in
        `place`: the head leads the ring, a member follows the head there."""
        windows = job.windows
        busy = (self.head and self.head.requests) or (self.shard and self.shard.caches)
        if busy and not job.replan:
            raise Rejected(Code.FAILED_PRECONDITION, "requests are in flight; reassign when the ring is idle")
        await self.standby.stop()
        self.fetching = True
        try:
            if not windows.relay:
                await self._fetch_missing(windows, job.model_id, [place.head_address, *place.ring], progress)
            check_assignment(self.store, windows, job.model_id)  # a refused assignment leaves the ring as it was
            kv = job.kv
            if job.replan and kv == ("", 0) and self.shard:  # the head's re-plan: the KV the last plan gave survives
                kv = (self.shard.kv_dtype.name, self.shard.ctx)
            self.epoch = job.epoch  # frames of the old ring are dropped from now on
            await self._load(windows, progress, job.buffer_layers, kv)
        finally:
            self.fetching = False
        self.batching = (job.max_batch, job.micro_batches)  # as assigned (0: defaults), kept by the head's re-plans
        self.max_batch = job.max_batch or self.cfg.max_batch
        self.micro_batches = job.micro_batches or 1
        if windows.head:
            self.head_address = self._lead(list(place.ring), fresh=not job.replan).address
        else:
            await self._follow(place.head_address)
        head_windows = windows if windows.head else Windows(place.head_windows, windows.n_layers, True)
        self.standby.set(list(place.ring), head_windows, job.model_id, place.standby and not windows.head)
        self.standby.keep(self.store, [a for a in [self.head_address, *place.ring] if a != self.address], self.log)
        self.predicted = job.predicted  # what this assignment was planned to cost (a re-plan's has none)
        self.memory_low = False  # loaded within its memory cap: the owner's request is answered
        self.stats.decode_s, self.stats.decode_frames = 0.0, 0  # measured against it from now on
        self.log = self.log.bind(windows=[list(r) for r in windows.ranges], role=self.role)
        self.log.info("assigned")

    async def _fetch_missing(self, windows: Windows, model_id: str, sources: list[str], progress) -> None:
        """Load `windows` from the cache when this node's store lacks their units (weights.store_for)."""
        def fetched(n: int) -> None:
            self.fetched_bytes += n

        store = await weights.store_for(windows, model_id, self.store, self.cfg.cache,
                                        [s for s in sources if s != self.address], self.cfg.token, progress,
                                        self.log, fetched)
        if store is not None:
            self.store, self.cached_units = store, weights.count_units(store)

    async def _load(self, windows: Windows, progress, buffer_layers: float, kv: tuple[str, int] = ("", 0)) -> None:
        # The head keeps its tokenizer through a re-plan: requests that arrive meanwhile wait for the ring.
        old, self.windows, self.shard = self.shard, None, None
        if not windows.head:
            self.text = None
        loop = asyncio.get_running_loop()
        if old is not None:  # stop its prefetcher and free its memory before loading the new one
            self.stats.stall_s += old.stall_s
            self.stats.prefix_disk_tokens += old.disk_loaded
            await loop.run_in_executor(self.pool, old.close)
            del old
        if not windows.relay:
            budget = self.mem_budget or None  # None: derived from the RAM available now
            log = self.log.bind(windows=[list(r) for r in windows.ranges])
            # the dtype's first use times kernels: on the compute thread
            dtype = await loop.run_in_executor(self.pool, lambda: getattr(torch, self.dtype_name))
            self.shard = await loop.run_in_executor(self.pool, lambda: new_shard(
                self.cfg, self.store, windows, dtype, progress, budget, buffer_layers, kv, log))
            if windows.head and self.text is None:
                self.text = TextCodec(self.store.manifest, self.store.tokenizer_path())
        await loop.run_in_executor(self.pool, heap.give_back)  # the old windows' memory, freed on this thread
        self.windows = windows

    @property
    def mem_budget(self) -> int:
        """Bytes this node may use: the tightest of --mem-budget, --max-memory and what it kept after giving memory
        back to its owner (0: none set)."""
        return owner.budget(self.cfg.mem_budget, self.cfg.max_memory, self.memory_cap)

    @property
    def dtype_name(self) -> str:
        """The configured compute dtype, else by the store (once fetched) and this machine (dtype_choice.py)."""
        return compute_dtype(self.store.manifest.dtype if self.store else "float32", self.cfg.dtype)

    def info(self) -> pb.NodeInfo:
        return node_info.info(self)

    def holds_head_copy(self) -> bool:
        """This node's disk holds the head's units: it can become the head should the head be lost."""
        return self.standby.holds_copy(self.store)

    # ------------------------------------------------------------------ the role: only these change it

    async def take_over(self, lost: str, ring: list[str], handed: bool = False, forget: bool = False) -> None:
        """Become the head in place of `lost` (failover, hand-over) and re-plan the members after this node, round to
        it (`lost` keeps its place, to rejoin there). handed: it handed over (answers until it stops); forget: left."""
        if self.address not in ring:
            self.log.error("cannot take over: this node is not in the ring as the head named it", ring=ring)
            return
        i = ring.index(self.address)
        order = tuple(ring[i + 1:] + ring[:i])
        self.log.warning("taking over as the ring's head", lost=lost, ring=[self.address, *order])
        head = self._lead([self.address, *(a for a in order if a != lost)], fresh=True)
        await head.members.take_over(lost, order, handed, forget)

    async def step_down(self, head: str, why: str) -> None:
        """Give the head role to `head` (hand-over, split brain): serve no frames until it assigns this node."""
        self.windows = None
        await self._follow(head, why)

    def _lead(self, ring: list[str], fresh: bool) -> Head:
        """Be the head of `ring` (its own address first): a new Head, or the one held rewired. fresh: from prima-ctl."""
        if self.head is None:
            self.head = Head(self, ring, fresh=True)
        else:
            self.head.rewire(ring, fresh)
        return self.head

    async def _follow(self, head: str, why: str = "") -> None:
        """Follow `head`; a Head this node held closes, its requests ended UNAVAILABLE (`why`: the reason given)."""
        old, self.head, self.head_address = self.head, None, head
        if old is not None:
            await old.close(why)

    # ------------------------------------------------------------------ frames in

    async def accept_frame(self, frame: pb.Frame) -> None:
        """Validate a frame from the predecessor and queue it; Rejected says why not."""
        start = time.perf_counter()
        try:
            await self._accept_frame(frame)
        finally:
            self.spans.add("receive", time.perf_counter() - start)

    async def _accept_frame(self, frame: pb.Frame) -> None:
        """Structure first; then frames of another epoch (an older ring, still in flight when the ring was
        re-planned) are dropped; then what only the current ring can judge."""
        admit.check_structure(frame)
        if self.windows is None:
            raise Rejected(Code.FAILED_PRECONDITION, "this node has no assignment yet (prima-ctl start)")
        hidden = None
        if frame.kind == pb.FORWARD and not self.windows.relay:
            hidden = admit.checked_hidden(frame, self.store.config.hidden)
        if frame.epoch != self.epoch:
            self.log.debug("stale frame dropped", request_id=frame.request_id, epoch=frame.epoch)
            return
        if self.windows.relay:
            await self.outbox.put(frame)  # relays hold no model: forward unchanged
        elif frame.kind == pb.ERROR:
            await self.inbox.put(Work(frame.request_id, pb.ERROR, error=frame.error[:1000],
                                      code=frames.status_from_wire(frame.code), epoch=frame.epoch))
        elif frame.kind == pb.RELEASE:
            await self.inbox.put(Work(frame.request_id, pb.RELEASE, epoch=frame.epoch))
        elif self.head is not None and not self.head.requests.known(frame.request_id):
            # A request that ended (cancelled, say) while its frame went round: drop the frame. Refusing it would
            # close the stream and lose the frames of other requests sent right behind it (its batch).
            self.log.debug("frame of an ended request dropped", request_id=frame.request_id)
        else:
            known = frame.request_id in self.shard.caches or (self.head is not None
                                                              and self.head.requests.known(frame.request_id))
            admit.check_in_ring(frame, hidden, self.windows, self.store.config.max_seq_len, known)
            await self.inbox.put(admit.forward_work(frame, hidden))

    # ------------------------------------------------------------------ the loops

    async def run(self) -> None:
        """The node's coroutines until cancelled; the link, channels and compute thread closed after."""
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._compute_loop(), name="compute")
                tasks.create_task(loops.send(self), name="send")
                tasks.create_task(loops.watch(self), name="watch")
                tasks.create_task(loops.owner(self), name="owner")
                tasks.create_task(loops.replan(self), name="replan")
        finally:
            if self.head is not None:
                await self.head.close()
            await self.link.close()
            self.pool.shutdown(wait=False, cancel_futures=True)

    async def _compute_loop(self) -> None:
        while True:
            work = await self.inbox.get()
            batch = [work]
            try:
                if self._computes(work):
                    batch = await batching.gather(self.inbox, work, self.max_batch)
                    await self._run_batch(batch)
                else:
                    await self._handle(work)
            except Exception as exc:  # one failed batch must not stop the node; its heads learn why at once
                self.log.exception("frame failed", request_id=work.request_id, batch=len(batch))
                for w in batch:
                    await self._fail_request(w.request_id, Code.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _computes(self, w: Work) -> bool:
        """A FORWARD frame of the current ring that this node computes now (not delivers or passes on)."""
        return (w.kind == pb.FORWARD and w.epoch == self.epoch and self.windows is not None
                and self.windows.step(w.next_layer) is Step.COMPUTE)

    async def _run_batch(self, batch: list[Work]) -> None:
        """Compute a batch in one pass over the weights; then each request goes on as its own frame (sent back
        to back, batch_rest counting down, so the next node computes them together too) or to the head. A
        request whose frame does not fit (positions, KV room) fails alone."""
        head, shard = self.head, self.shard
        ready = await self._with_caches(batch)
        if not ready:
            return
        start = time.perf_counter()
        items = [(w.hidden, cache, w.start_pos) for w, cache in ready]
        try:
            hidden, next_layer = await run_job(self.pool, shard.compute_batch, items, batch[0].next_layer)
        except ValueError as exc:  # a streamed layer that could not be read: every request of the batch fails
            for w, _ in ready:
                await self._fail_request(w.request_id, Code.INVALID_ARGUMENT, str(exc))
            return
        batching.count_batch(self.stats, [w for w, _ in ready], start, time.perf_counter() - start,
                             first_pass=batch[0].next_layer == shard.windows.ranges[0][0])
        self.spans.add("inbox", start - batch[0].queued)
        if batch[0].epoch != self.epoch:  # re-planned while computing: the results belong to the old ring
            return
        done = [replace(w, hidden=h, next_layer=next_layer) for (w, _), h in zip(ready, hidden, strict=True)]
        if self.windows.step(next_layer) is Step.DELIVER:
            if head is not None:
                await head.deliver_batch([(w.request_id, w.hidden, w.window) for w in done])
            return
        for i, w in enumerate(done):
            encoding, frame = time.perf_counter(), frames.forward(w, batch_rest=len(done) - 1 - i)
            self.spans.add("encode", time.perf_counter() - encoding)
            await self.outbox.put(frame)

    async def _with_caches(self, batch: list[Work]) -> list[tuple[Work, KVCache]]:
        """The frames of `batch` with their KV caches, made if new; a request whose frame does not fit
        (positions, KV room) fails alone, and one that ended (or never existed) gets no cache."""
        head, shard = self.head, self.shard
        ready = []
        for w in batch:
            if head is not None and not head.requests.known(w.request_id):
                continue
            try:
                if w.request_id not in shard.caches:
                    self._make_room()
                cache = shard.cache_for(w.request_id, w.start_pos, w.capacity, w.hidden.shape[0], w.prefix)
            except Exception as exc:
                await self._fail_request(w.request_id, *batching.failure(exc))
                continue
            self.cache_used[w.request_id] = time.monotonic()
            ready.append((w, cache))
        return ready

    async def _handle(self, w: Work) -> None:
        """Everything but a compute: RELEASE, ERROR, and FORWARD frames this node delivers or passes on."""
        if w.epoch != self.epoch or self.windows is None:  # queued before the ring was re-planned
            return
        head = self.head
        if w.kind == pb.RELEASE:
            self.release(w.request_id)
            if head is None:
                await self.outbox.put(frames.release(w.request_id, w.epoch))
            return
        if w.kind == pb.ERROR:
            if head is not None:
                head.requests.fail(w.request_id, RequestFailed(w.code, w.error))
            else:
                await self.outbox.put(frames.error(w.request_id, w.code, w.error, w.epoch))
            return
        if head is not None and not head.requests.known(w.request_id):
            return
        if self.windows.step(w.next_layer) is Step.DELIVER:
            if head is not None:
                head.requests.deliver(w.request_id, w.hidden, w.window)
            return
        await self.outbox.put(frames.forward(w, w.batch_rest))

    def release(self, request_id: str) -> None:
        self.shard.release(request_id)
        self.cache_used.pop(request_id, None)

    def _make_room(self) -> None:
        """Bound the KV caches a node keeps: drop ones idle for long (their RELEASE was lost), or refuse."""
        if len(self.shard.caches) < MAX_CACHES:
            return
        now = time.monotonic()
        for rid in [r for r in self.shard.caches if now - self.cache_used.get(r, 0.0) > CACHE_IDLE_S]:
            self.release(rid)
        if len(self.shard.caches) >= MAX_CACHES:
            raise Rejected(Code.RESOURCE_EXHAUSTED, f"this node already holds KV caches for {MAX_CACHES} requests")

    async def _fail_request(self, request_id: str, code: Code, message: str) -> None:
        """End a request everywhere: free its cache here and tell the head (an ERROR frame round the ring)."""
        message = f"{self.cfg.name or self.address}: {message}"
        self.log.warning("request failed", request_id=request_id, error=message)
        if self.shard is not None:
            self.release(request_id)
        if self.head is not None:
            self.head.requests.fail(request_id, RequestFailed(code, message))
        elif self.windows is not None:
            await self.outbox.put(frames.error(request_id, code, message, self.epoch))

    async def set_peer(self, peer: str, drain: float = 0.0) -> None:
        """drain: seconds the old link has to deliver the frames already written (a join replays none)."""
        if peer != self.peer:
            old, self.peer = self.link, peer
            self.link = RingLink(peer, self.cfg.token)
            await old.close(drain)
