"""The node actor: frames in, windows computed on one compute thread, frames out to the successor.

Tasks: the Ring service receives and validates frames into `inbox`; `compute_loop` runs them (torch
work off the event loop on a single thread); `send_loop` writes `outbox` to the successor. Every
request has at most one frame in flight, so queues longer than the request limit cannot deadlock
the ring.
"""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
import structlog
import torch

from nodes.generation import GenerateParams, Generation, TokenOut
from nodes.link import LinkDown, RingLink
from nodes.routing import Step, Windows
from nodes.shard import Shard, check_assignment
from nodes.store import LayerStore
from nodes.text import TextCodec
from prima_rpc import codec
from prima_rpc.channel import MAX_MESSAGE_BYTES
from prima_rpc.v1 import prima_pb2 as pb

log = structlog.get_logger()
MAX_REQUESTS = 64
QUEUE = 4 * MAX_REQUESTS
PREFILL_CHUNK = 256  # prompt tokens per ring frame
MAX_ID = 128


@dataclass(frozen=True)
class NodeConfig:
    port: int = 0
    host: str = "0.0.0.0"
    peer: str = ""
    model: Path | None = None
    name: str = ""
    mem_budget: int = 0
    token: str | None = None
    dtype: str = "float32"
    step_timeout: float = 60.0  # head: longest wait for one ring round trip


class Rejected(Exception):
    """A request or frame refused before use; `code` is the gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class RequestFailed(Exception):
    """A ring node reported an error for this request."""


@dataclass
class Work:
    request_id: str
    kind: int
    start_pos: int = 0
    next_layer: int = 0
    capacity: int = 0
    hidden: torch.Tensor | None = None
    error: str = ""


@dataclass
class Stats:
    compute_s: float = 0.0
    link_s: float = 0.0
    frames: int = 0
    last_token_ms: float = 0.0


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


class Node:
    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.node_id = uuid.uuid4().hex
        self.address = f"{cfg.host}:{cfg.port}"
        self.store = LayerStore(cfg.model) if cfg.model else None
        self.dtype = getattr(torch, cfg.dtype)
        self.windows: Windows | None = None
        self.shard: Shard | None = None
        self.text: TextCodec | None = None
        self.last_error = ""
        self.inbox: asyncio.Queue[Work] = asyncio.Queue(QUEUE)
        self.outbox: asyncio.Queue[pb.Frame] = asyncio.Queue(QUEUE)
        self.link = RingLink(cfg.peer, cfg.token)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.requests: dict[str, HeadRequest] = {}
        self.stats = Stats()
        self.log = log.bind(node=cfg.name or self.address)

    # ------------------------------------------------------------------ roles and loading

    @property
    def role(self) -> str:
        if self.windows is None:
            return "idle"
        return "head" if self.windows.head else "relay" if self.windows.relay else "worker"

    async def assign(self, windows: Windows, model_id: str, progress) -> None:
        """Load the layers of `windows` (off the loop), reporting progress(done, total, unit)."""
        if self.requests or (self.shard and self.shard.caches):
            raise Rejected("FAILED_PRECONDITION", "requests are in flight; reassign when the ring is idle")
        check_assignment(self.store, windows, model_id)
        self.windows, self.shard, self.text = None, None, None
        if not windows.relay:
            loop = asyncio.get_running_loop()
            self.shard = await loop.run_in_executor(self.pool, Shard, self.store, windows, self.dtype, progress)
            if windows.head:
                self.text = TextCodec(self.store.manifest, self.store.tokenizer_path())
        self.windows = windows
        self.log = self.log.bind(windows=[list(r) for r in windows.ranges], role=self.role)
        self.log.info("assigned")

    def info(self) -> pb.NodeInfo:
        rss = psutil.Process().memory_info().rss
        return pb.NodeInfo(
            name=self.cfg.name or self.address, address=self.address, peer=self.cfg.peer, role=self.role,
            windows=[pb.LayerRange(start=a, stop=b) for a, b in (self.windows.ranges if self.windows else ())],
            loaded=self.windows is not None,
            n_layers=self.store.config.n_layers if self.store else 0,
            model_id=self.store.model_id if self.store else "",
            model_name=self.store.manifest.name if self.store else "",
            mem_budget=self.cfg.mem_budget, node_id=self.node_id, error=self.last_error,
            stats=pb.NodeStats(
                resident_bytes=self.shard.resident_bytes() if self.shard else 0,
                disk_read_bytes=self.store.bytes_read if self.store else 0,
                compute_s=self.stats.compute_s, link_s=self.stats.link_s, frames=self.stats.frames,
                last_token_ms=self.stats.last_token_ms, rss_bytes=rss,
                active_requests=len(self.shard.caches) if self.shard else 0,
            ),
        )

    # ------------------------------------------------------------------ frames in

    async def accept_frame(self, frame: pb.Frame) -> None:
        """Validate a frame from the predecessor and queue it; Rejected says why not."""
        if frame.kind not in (pb.FORWARD, pb.RELEASE, pb.ERROR):
            raise Rejected("INVALID_ARGUMENT", f"unknown frame kind {frame.kind}")
        if not (0 < len(frame.request_id) <= MAX_ID):
            raise Rejected("INVALID_ARGUMENT", f"request_id must have 1..{MAX_ID} characters")
        if self.windows is None:
            raise Rejected("FAILED_PRECONDITION", "this node has no assignment yet (prima-ctl start)")
        if self.windows.relay:
            await self.outbox.put(frame)  # relays hold no model: forward unchanged
            return
        if frame.kind == pb.ERROR:
            await self.inbox.put(Work(frame.request_id, pb.ERROR, error=frame.error[:1000]))
            return
        if frame.kind == pb.RELEASE:
            await self.inbox.put(Work(frame.request_id, pb.RELEASE))
            return
        await self.inbox.put(self._checked_forward(frame))

    def _checked_forward(self, frame: pb.Frame) -> Work:
        cfg = self.store.config
        why = self.windows.check_received(frame.next_layer)
        if why:
            raise Rejected("INVALID_ARGUMENT", why)
        try:
            hidden = codec.decode(frame.hidden, max_bytes=MAX_MESSAGE_BYTES)
        except codec.CodecError as exc:
            raise Rejected("INVALID_ARGUMENT", f"hidden: {exc}") from None
        if hidden.dim() != 2 or hidden.shape[1] != cfg.hidden or hidden.shape[0] == 0:
            raise Rejected("INVALID_ARGUMENT", f"hidden must be [tokens >= 1, {cfg.hidden}], got {list(hidden.shape)}")
        if frame.start_pos + hidden.shape[0] > cfg.max_seq_len:
            raise Rejected("OUT_OF_RANGE", f"positions up to {frame.start_pos + hidden.shape[0]} exceed the "
                                           f"context {cfg.max_seq_len}")
        known = frame.request_id in self.shard.caches or frame.request_id in self.requests
        if frame.start_pos > 0 and not known:
            raise Rejected("NOT_FOUND", f"unknown request id {frame.request_id!r}")
        return Work(frame.request_id, pb.FORWARD, frame.start_pos, frame.next_layer, frame.capacity, hidden)

    # ------------------------------------------------------------------ the loops

    async def compute_loop(self) -> None:
        while True:
            work = await self.inbox.get()
            try:
                await self._handle(work)
            except Exception:  # one bad request must not stop the node
                self.log.exception("frame failed", request_id=work.request_id)

    async def _handle(self, w: Work) -> None:
        head = self.windows.head
        if w.kind == pb.RELEASE:
            self.shard.release(w.request_id)
            if not head:
                await self.outbox.put(pb.Frame(request_id=w.request_id, kind=pb.RELEASE))
            return
        if w.kind == pb.ERROR:
            if head:
                if w.request_id in self.requests:
                    self.requests[w.request_id].fail(w.error)
            else:
                await self.outbox.put(pb.Frame(request_id=w.request_id, kind=pb.ERROR, error=w.error))
            return
        step = self.windows.step(w.next_layer)
        if step is Step.COMPUTE:
            try:
                w = await self._compute(w)
            except ValueError as exc:
                return await self._fail_request(w.request_id, str(exc))
            step = self.windows.step(w.next_layer)
        if step is Step.DELIVER:
            req = self.requests.get(w.request_id)
            if req is not None:
                req.deliver(w.hidden)
            return
        await self.outbox.put(pb.Frame(request_id=w.request_id, kind=pb.FORWARD, start_pos=w.start_pos,
                                       next_layer=w.next_layer, capacity=w.capacity, hidden=codec.encode(w.hidden)))

    async def _compute(self, w: Work) -> Work:
        cache = self.shard.cache_for(w.request_id, w.start_pos, w.capacity, w.hidden.shape[0])
        start = time.perf_counter()
        hidden, next_layer = await asyncio.get_running_loop().run_in_executor(
            self.pool, self.shard.compute, w.hidden, cache, w.start_pos, w.next_layer)
        self.stats.compute_s += time.perf_counter() - start
        self.stats.frames += 1
        return replace(w, hidden=hidden, next_layer=next_layer)

    async def _fail_request(self, request_id: str, message: str) -> None:
        message = f"{self.cfg.name or self.address}: {message}"
        self.log.warning("request failed", request_id=request_id, error=message)
        self.shard.release(request_id)
        if self.windows.head:
            if request_id in self.requests:
                self.requests[request_id].fail(message)
        else:
            await self.outbox.put(pb.Frame(request_id=request_id, kind=pb.ERROR, error=message))

    async def send_loop(self) -> None:
        while True:
            frame = await self.outbox.get()
            start = time.perf_counter()
            try:
                await self.link.send(frame)
            except LinkDown as exc:
                self.last_error = str(exc)
                self.log.warning("link down", error=str(exc))
                if frame.request_id in self.requests:
                    self.requests[frame.request_id].fail(str(exc))
            self.stats.link_s += time.perf_counter() - start

    # ------------------------------------------------------------------ the head

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
        loop = asyncio.get_running_loop()
        try:
            while not gen.done:
                ids, pos = gen.pending()
                start = time.perf_counter()
                for offset in range(0, len(ids), PREFILL_CHUNK):
                    chunk = ids[offset:offset + PREFILL_CHUNK]
                    x = await loop.run_in_executor(self.pool, self.shard.embed, chunk)
                    req.waiter = loop.create_future()
                    await self.inbox.put(Work(request_id, pb.FORWARD, pos + offset, 0, gen.capacity, x))
                    try:
                        hidden = await asyncio.wait_for(req.waiter, self.cfg.step_timeout)
                    except TimeoutError:
                        raise RequestFailed(f"no answer from the ring within {self.cfg.step_timeout:.0f} s "
                                            "(a node may be down)") from None
                logits = await loop.run_in_executor(self.pool, self.shard.logits, hidden)
                self.stats.last_token_ms = (time.perf_counter() - start) * 1e3
                yield gen.accept(logits)
            yield gen
        finally:
            del self.requests[request_id]
            # Free every node's KV cache: the RELEASE frame goes once round the ring. No await here:
            # this also runs when the client's call is cancelled.
            self.shard.release(request_id)
            try:
                self.outbox.put_nowait(pb.Frame(request_id=request_id, kind=pb.RELEASE))
            except asyncio.QueueFull:
                self.log.warning("release not sent: outbox full", request_id=request_id)

    def cancel(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.fail("cancelled")
        return True

