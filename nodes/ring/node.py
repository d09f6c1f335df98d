"""The node actor: frames in, windows computed on one compute thread, frames out to the successor.

State plus three named coroutines (`run`): the Ring service validates frames into `inbox`; "compute"
runs them, the frames waiting for the same layers together as one batch (torch work off the event loop on a
single thread); "send" writes `outbox` to the successor;
"watch" lets the head (only the head node holds a `Head`) probe its members. Every request has at most
one frame in flight, so queues longer than the request limit cannot deadlock the ring.
"""

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import psutil
import structlog
import torch

from nodes.engine.fused import layer_bytes
from nodes.engine.quant import compute_dtype, weight_format
from nodes.engine.shard import Shard, check_assignment
from nodes.engine.store import LayerStore
from nodes.errors import LinkDown, Rejected, RequestFailed
from nodes.generation.text import TextCodec
from nodes.ring import fetch, frames
from nodes.ring.head import Head
from nodes.ring.inbox import Inbox
from nodes.ring.link import RingLink
from nodes.ring.members import PROBE_INTERVAL
from nodes.ring.work import BATCH_WAIT_S, CACHE_IDLE_S, MAX_BATCH, MAX_CACHES, MAX_ID, MAX_REQUESTS, QUEUE, Work
from prima_rpc import codec
from prima_rpc.channel import MAX_MESSAGE_BYTES
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.windows import Step, Windows
from prima_rpc.v1 import prima_pb2 as pb

log = structlog.get_logger()
Code = grpc.StatusCode


@dataclass(frozen=True)
class NodeConfig:
    port: int = 0
    host: str = "0.0.0.0"
    peer: str = ""
    model: Path | None = None
    cache: Path | None = None  # where weights fetched from other nodes go (None: never fetch)
    name: str = ""
    mem_budget: int = 0
    token: str | None = None
    dtype: str | None = None  # compute dtype; None: by the store (bfloat16 for int8/int4 stores, else float32)
    step_timeout: float = 60.0  # head: longest wait for one ring round trip
    draft: Path | None = None  # a draft model store the head runs for speculate=draft
    fault_layer: int = -1  # fault injection for tests (PRIMA_FAULT_LAYER): the first compute of this layer raises
    max_batch: int = MAX_BATCH  # frames one compute takes at most (an assignment may set another)


@dataclass
class Stats:
    compute_s: float = 0.0  # wall time of frames in the compute thread, waits for streamed layers included
    stall_s: float = 0.0  # waits for streamed layers, of shards already replaced (the current one counts its own)
    link_s: float = 0.0
    frames: int = 0
    last_token_ms: float = 0.0
    decode_s: float = 0.0  # of compute_s, frames of one token since the assignment: status's per-token figure
    decode_frames: int = 0
    batches: int = 0  # computes run; frames computed in them below (mean batch = batched_frames / batches)
    batched_frames: int = 0
    max_batch_seen: int = 0
    queue_wait_s: float = 0.0  # frames' time in the inbox before their compute


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
        self.cached_units = self._count_units()
        self.last_error = ""
        self.peer = cfg.peer
        self.epoch = 0  # frames of another epoch (an older ring) are dropped
        self.inbox: Inbox = Inbox(QUEUE)
        self.outbox: asyncio.Queue[pb.Frame] = asyncio.Queue(QUEUE)
        self.link = RingLink(cfg.peer, cfg.token)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.cache_used: dict[str, float] = {}  # request id -> when its KV cache was last used
        self.stats = Stats()
        self.predicted = (0.0, 0.0)  # the applied plan's (ms per token here, ring TPOT ms); Info reports it
        self.log = log.bind(node=cfg.name or self.address)
        self._fault_layer = cfg.fault_layer
        self.max_batch = cfg.max_batch  # frames one compute takes (the assignment's, else the node's default)
        self.micro_batches = 1  # head: batches of requests in flight round the ring
        self.batching = (0, 0)

    # ------------------------------------------------------------------ roles and loading

    @property
    def role(self) -> str:
        if self.windows is None:
            return "idle"
        return "head" if self.windows.head else "relay" if self.windows.relay else "worker"

    async def assign(self, windows: Windows, model_id: str, progress, epoch: int = 0, replan: bool = False,
                     ring: list[str] = (), buffer_layers: float = 0.0, head_address: str = "", max_batch: int = 0,
                     micro_batches: int = 0, predicted: tuple[float, float] = (0.0, 0.0)) -> None:
        """Load the layers of `windows` (off the loop), reporting progress(done, total, unit).

        replan: the head re-plans after losing a node; in-flight KV caches are dropped (they replay).
        ring: (head) every member's address in ring order, its own first, watched for failures.
        buffer_layers: the plan's stream buffer, in layers (0: the default), used if the budget streams.
        head_address: (members) the ring's head, as the ring dials it.
        max_batch, micro_batches: the plan's batch limit and (head) batches in flight; 0: the node's defaults.
        predicted: the plan's (per-token ms of this node, TPOT ms of the ring), shown by status; (0, 0): none."""
        busy = (self.head and self.head.requests) or (self.shard and self.shard.caches)
        if busy and not replan:
            raise Rejected(Code.FAILED_PRECONDITION, "requests are in flight; reassign when the ring is idle")
        self.fetching = True
        try:
            if not windows.relay:
                await self._fetch_missing(windows, model_id, [head_address, *ring], progress)
            check_assignment(self.store, windows, model_id)  # a refused assignment leaves the ring as it was
            self.epoch = epoch  # frames of the old ring are dropped from now on
            await self._load(windows, progress, buffer_layers)
        finally:
            self.fetching = False
        self.batching = (max_batch, micro_batches)  # as assigned (0: defaults), kept by the head's re-plans
        self.max_batch = max_batch or self.cfg.max_batch
        self.micro_batches = micro_batches or 1
        if windows.head:
            if self.head is None:
                self.head = Head(self, list(ring), fresh=True)
            else:
                self.head.rewire(list(ring), fresh=not replan)
            self.head_address = self.head.address
        else:
            old, self.head = self.head, None
            if old is not None:
                await old.close()
            self.head_address = head_address
        self.predicted = predicted  # what this assignment was planned to cost (a re-plan's has none)
        self.stats.decode_s, self.stats.decode_frames = 0.0, 0  # measured against it from now on
        self.log = self.log.bind(windows=[list(r) for r in windows.ranges], role=self.role)
        self.log.info("assigned")

    async def _fetch_missing(self, windows: Windows, model_id: str, sources: list[str], progress) -> None:
        """Fetch the manifest, tokenizer and the unit files of `windows` this node lacks from `sources` (the
        head first) into the cache, and load from there; a store of another model is left to refuse."""
        units = (["embed", "head"] if windows.head else []) + [f"layer.{i}" for a, b in windows.ranges
                                                              for i in range(a, b)]
        store = self.store
        if store is not None and (store.model_id != model_id or not fetch.needed_units(store, units)):
            return
        if self.cfg.cache is None:
            return  # check_assignment says what is missing
        try:  # what an earlier run fetched
            cached = LayerStore(fetch.cache_dir(self.cfg.cache, model_id))
            if cached.model_id == model_id and not fetch.needed_units(cached, units):
                self.store, self.cached_units = cached, self._count_units(cached)
                return
        except StoreError:
            pass
        fetcher = fetch.Fetcher(self.cfg.cache, model_id, [s for s in sources if s != self.address], self.cfg.token,
                                lambda done, total, unit: progress(done, total, unit, True))
        self.log.info("fetching weights", units=len(units), sources=fetcher.sources)
        try:
            self.store = await fetcher.store(units, windows.head)
        finally:
            self.fetched_bytes += fetcher.fetched
            await fetcher.close()
        self.cached_units = self._count_units()
        self.log.info("fetched weights", bytes=fetcher.fetched, cache=str(self.store.root))

    def _count_units(self, store: LayerStore | None = None) -> int:
        store = store or self.store
        if store is None or store.manifest.manifest_only:
            return 0
        units = store.manifest.units()
        return len(units) - len(fetch.needed_units(store, units))

    async def _load(self, windows: Windows, progress, buffer_layers: float) -> None:
        # The head keeps its tokenizer through a re-plan: requests that arrive meanwhile wait for the ring.
        old, self.windows, self.shard = self.shard, None, None
        if not windows.head:
            self.text = None
        loop = asyncio.get_running_loop()
        if old is not None:  # stop its prefetcher and free its memory before loading the new one
            self.stats.stall_s += old.stall_s
            await loop.run_in_executor(self.pool, old.close)
            del old
        if not windows.relay:
            budget = self.cfg.mem_budget or None  # None: derived from the RAM available now
            log = self.log.bind(windows=[list(r) for r in windows.ranges])
            fmt = weight_format(self.store.manifest)
            buffer = int(buffer_layers * layer_bytes(self.store.config, self.dtype, fmt))
            self.shard = await loop.run_in_executor(self.pool, lambda: Shard(
                self.store, windows, self.dtype, progress, budget=budget, buffer=buffer, log=log))
            if windows.head and self.text is None:
                self.text = TextCodec(self.store.manifest, self.store.tokenizer_path())
        self.windows = windows

    @property
    def dtype_name(self) -> str:
        """The compute dtype: the configured one, else by the store (known only once fetched, for a cache)."""
        return compute_dtype(self.store.manifest.dtype if self.store else "float32", self.cfg.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    @property
    def state(self) -> str:
        return "fetching" if self.fetching else "up"

    def info(self) -> pb.NodeInfo:
        rss = psutil.Process().memory_info().rss
        stall = self.stats.stall_s + (self.shard.stall_s if self.shard else 0.0)
        stats = frames.node_stats(
            resident_bytes=self.shard.resident_bytes() if self.shard else 0,
            disk_read_bytes=self.store.bytes_read if self.store else 0,
            compute_s=self.stats.compute_s - stall, stall_s=stall, link_s=self.stats.link_s, frames=self.stats.frames,
            last_token_ms=self.stats.last_token_ms, rss_bytes=rss, decode_s=self.stats.decode_s,
            decode_frames=self.stats.decode_frames,
            active_requests=len(self.shard.caches) if self.shard else 0,
            batches=self.stats.batches, batched_frames=self.stats.batched_frames,
            max_batch_seen=self.stats.max_batch_seen, queue_depth=self.inbox.qsize(),
            queue_wait_s=self.stats.queue_wait_s, max_batch=self.max_batch)
        return frames.node_info(
            stats=stats, windows=self.windows.ranges if self.windows else (),
            members=self.head.members.states() if self.head else (),
            name=self.cfg.name or self.address, address=self.address, peer=self.peer, role=self.role,
            loaded=self.windows is not None, n_layers=self.store.config.n_layers if self.store else 0,
            model_id=self.store.model_id if self.store else "",
            model_name=self.store.manifest.name if self.store else "",
            mem_budget=self.shard.plan.budget if self.shard else self.cfg.mem_budget,
            node_id=self.node_id, error=self.last_error, epoch=self.epoch, state=self.state, head=self.head_address,
            cached_units=self.cached_units, fetched_bytes=self.fetched_bytes,
            predicted_ms=self.predicted[0], predicted_tpot_ms=self.predicted[1])

    # ------------------------------------------------------------------ frames in

    async def accept_frame(self, frame: pb.Frame) -> None:
        """Validate a frame from the predecessor and queue it; Rejected says why not.

        Structure is checked first; then frames of another epoch (an older ring, still in flight
        when the ring was re-planned) are dropped; then what only the current ring can judge."""
        if frame.kind not in (pb.FORWARD, pb.RELEASE, pb.ERROR):
            raise Rejected(Code.INVALID_ARGUMENT, f"unknown frame kind {frame.kind}")
        if not (0 < len(frame.request_id) <= MAX_ID):
            raise Rejected(Code.INVALID_ARGUMENT, f"request_id must have 1..{MAX_ID} characters")
        if frame.batch_rest >= MAX_REQUESTS or (frame.batch_rest and frame.kind != pb.FORWARD):
            raise Rejected(Code.INVALID_ARGUMENT, f"batch_rest {frame.batch_rest} must be below {MAX_REQUESTS}, "
                                                  "and 0 except on FORWARD frames")
        if self.windows is None:
            raise Rejected(Code.FAILED_PRECONDITION, "this node has no assignment yet (prima-ctl start)")
        hidden = self._checked_hidden(frame) if frame.kind == pb.FORWARD and not self.windows.relay else None
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
        elif self.head is not None and not self.head.known(frame.request_id):
            # A request that ended (cancelled, say) while its frame went round: drop the frame. Refusing it would
            # close the stream and lose the frames of other requests sent right behind it (its batch).
            self.log.debug("frame of an ended request dropped", request_id=frame.request_id)
        else:
            self._check_in_ring(frame, hidden)
            await self.inbox.put(Work(frame.request_id, pb.FORWARD, frame.start_pos, frame.next_layer,
                                      frame.capacity, hidden, epoch=frame.epoch, batch_rest=frame.batch_rest))

    def _checked_hidden(self, frame: pb.Frame) -> torch.Tensor:
        cfg = self.store.config
        try:
            hidden = codec.decode(frame.hidden, max_bytes=MAX_MESSAGE_BYTES)
        except codec.CodecError as exc:
            raise Rejected(Code.INVALID_ARGUMENT, f"hidden: {exc}") from None
        if hidden.dim() != 2 or hidden.shape[1] != cfg.hidden or hidden.shape[0] == 0:
            raise Rejected(Code.INVALID_ARGUMENT,
                           f"hidden must be [tokens >= 1, {cfg.hidden}], got {list(hidden.shape)}")
        return hidden

    def _check_in_ring(self, frame: pb.Frame, hidden: torch.Tensor) -> None:
        cfg = self.store.config
        why = self.windows.check_received(frame.next_layer)
        if why:
            raise Rejected(Code.INVALID_ARGUMENT, why)
        if frame.start_pos + hidden.shape[0] > cfg.max_seq_len:
            raise Rejected(Code.OUT_OF_RANGE, f"positions up to {frame.start_pos + hidden.shape[0]} exceed the "
                                           f"context {cfg.max_seq_len}")
        known = frame.request_id in self.shard.caches or (self.head is not None and self.head.known(frame.request_id))
        if frame.start_pos > 0 and not known:
            raise Rejected(Code.NOT_FOUND, f"unknown request id {frame.request_id!r}")

    # ------------------------------------------------------------------ the loops

    async def run(self) -> None:
        """The node's coroutines until cancelled; the link, channels and compute thread closed after."""
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._compute_loop(), name="compute")
                tasks.create_task(self._send_loop(), name="send")
                tasks.create_task(self._watch_loop(), name="watch")
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
                    batch = await self._gather(work)
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

    async def _gather(self, first: Work) -> list[Work]:
        """`first` and the frames of other requests waiting for the same layers of the same ring, up to the
        node's max batch, in arrival order. Frames that cannot join stay queued in their order. When the last
        frame taken says more of its batch follow (batch_rest), wait for them briefly (BATCH_WAIT_S), but not
        once a frame that cannot join is waiting (it must not be held back)."""
        batch, ids = [first], {first.request_id}

        def joins(w: Work) -> bool:
            return (w.kind == pb.FORWARD and w.next_layer == first.next_layer and w.epoch == first.epoch
                    and w.request_id not in ids)

        deadline = time.perf_counter() + BATCH_WAIT_S
        while len(batch) < self.max_batch:
            taken = self.inbox.take(joins, self.max_batch - len(batch))
            batch += taken
            ids.update(w.request_id for w in taken)
            left = deadline - time.perf_counter()
            if batch[-1].batch_rest == 0 or len(batch) >= self.max_batch or not self.inbox.empty() or left <= 0:
                break
            if not await self.inbox.arrival(left):
                break
        return batch

    async def _run_batch(self, batch: list[Work]) -> None:
        """Compute a batch in one pass over the weights; then each request goes on as its own frame (sent back
        to back, batch_rest counting down, so the next node computes them together too) or to the head. A
        request whose frame does not fit (positions, KV room) fails alone."""
        head, shard = self.head, self.shard
        ready: list[tuple[Work, object]] = []
        for w in batch:
            if head is not None and not head.known(w.request_id):
                continue  # a request that ended (or never existed): never give it a KV cache here
            try:
                if w.request_id not in shard.caches:
                    self._make_room()
                cache = shard.cache_for(w.request_id, w.start_pos, w.capacity, w.hidden.shape[0])
                self._inject_fault(w.next_layer)
            except Exception as exc:
                await self._fail_request(w.request_id, *_failure(exc))
                continue
            self.cache_used[w.request_id] = time.monotonic()
            ready.append((w, cache))
        if not ready:
            return
        start = time.perf_counter()
        items = [(w.hidden, cache, w.start_pos) for w, cache in ready]
        try:
            hidden, next_layer = await asyncio.get_running_loop().run_in_executor(
                self.pool, shard.compute_batch, items, batch[0].next_layer)
        except ValueError as exc:  # a streamed layer that could not be read: every request of the batch fails
            for w, _ in ready:
                await self._fail_request(w.request_id, Code.INVALID_ARGUMENT, str(exc))
            return
        s, took = self.stats, time.perf_counter() - start
        s.compute_s += took
        s.frames += len(ready)
        if all(w.hidden.shape[0] == 1 for w, _ in ready):  # a decode step: what a token waits for here
            s.decode_s += took
            s.decode_frames += 1
        s.batches += 1
        s.batched_frames += len(ready)
        s.max_batch_seen = max(s.max_batch_seen, len(ready))
        s.queue_wait_s += sum(start - w.queued for w, _ in ready)
        if batch[0].epoch != self.epoch:  # re-planned while computing: the results belong to the old ring
            return
        done = [replace(w, hidden=h, next_layer=next_layer) for (w, _), h in zip(ready, hidden, strict=True)]
        if self.windows.step(next_layer) is Step.DELIVER:
            if head is not None:
                await head.deliver_batch([(w.request_id, w.hidden) for w in done])
            return
        for i, w in enumerate(done):
            await self.outbox.put(frames.forward(w, batch_rest=len(done) - 1 - i))

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
                head.fail(w.request_id, RequestFailed(w.code, w.error))
            else:
                await self.outbox.put(frames.error(w.request_id, w.code, w.error, w.epoch))
            return
        if head is not None and not head.known(w.request_id):
            return
        if self.windows.step(w.next_layer) is Step.DELIVER:
            if head is not None:
                head.deliver(w.request_id, w.hidden)
            return
        await self.outbox.put(frames.forward(w, w.batch_rest))

    def _inject_fault(self, next_layer: int) -> None:
        """Fault injection for tests: the first compute that runs cfg.fault_layer raises, once."""
        layer = self._fault_layer
        if layer >= 0 and any(a <= layer < b for a, b in self.windows.run_from(next_layer)):
            self._fault_layer = -1
            raise RuntimeError(f"fault injected at layer {layer}")

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
            self.head.fail(request_id, RequestFailed(code, message))
        elif self.windows is not None:
            await self.outbox.put(frames.error(request_id, code, message, self.epoch))

    async def _send_loop(self) -> None:
        while True:
            frame = await self.outbox.get()
            start = time.perf_counter()
            try:
                await self.link.send(frame)
            except LinkDown as exc:
                self.last_error = str(exc)
                self.log.warning("link down", error=str(exc))
                if self.head is not None and self.head.known(frame.request_id):
                    self.head.members.link_down(frame.request_id, str(exc))
            self.stats.link_s += time.perf_counter() - start

    async def _watch_loop(self) -> None:
        """The head probes its members every second (members.py); other nodes only wait to become it."""
        while True:
            head = self.head
            if head is None:
                await asyncio.sleep(PROBE_INTERVAL)
            else:
                await head.members.round()

    async def set_peer(self, peer: str) -> None:
        if peer != self.peer:
            old, self.peer = self.link, peer
            self.link = RingLink(peer, self.cfg.token)
            await old.close()


def _failure(exc: Exception) -> tuple[Code, str]:
    """The status a request fails with when its frame cannot be computed."""
    if isinstance(exc, Rejected):
        return exc.code, str(exc)
    if isinstance(exc, ValueError):  # positions or capacity that do not fit this request's KV cache
        return Code.INVALID_ARGUMENT, str(exc)
    return Code.INTERNAL, f"{type(exc).__name__}: {exc}"
