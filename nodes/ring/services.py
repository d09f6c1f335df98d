"""Thin gRPC servicers over the node actor: validate, translate errors to statuses, stream."""

import asyncio
import json
import re
import time
import uuid

import grpc
from google.protobuf.message import DecodeError

from nodes.engine.kv_dtype import NAMES as KV_NAMES
from nodes.engine.prefetch import MAX_BUFFER_LAYERS
from nodes.errors import LinkDown, Rejected, RequestFailed
from nodes.generation.speculate import speculate_params
from nodes.generation.state import Generation, Prefilled, generate_params
from nodes.generation.text import PromptError
from nodes.jobs import run_job
from nodes.profiling.profiler import profile_device
from nodes.ring import fetch, frames, handover, metrics, owner
from nodes.ring.assignment import Assignment, Place
from nodes.ring.inflight import ahead
from nodes.ring.members import DRAIN
from nodes.ring.node import Node
from nodes.ring.run_ahead import run_ahead
from nodes.ring.work import MAX_REQUESTS, Work
from prima_rpc.request import GenerateRequest
from prima_rpc.spec.manifest import MANIFEST, StoreError
from prima_rpc.spec.windows import Windows
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc

MAX_PROMPT_CHARS = 1 << 20
PEER = re.compile(r"(?:[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}")  # host:port or [v6]:port
Code = grpc.StatusCode


async def abort(context, code: grpc.StatusCode, message: str):
    await context.abort(code, message)


class RingService(rpc.RingServicer):
    def __init__(self, node: Node):
        self.node = node

    async def Stream(self, request_iterator, context):
        try:
            async for frame in request_iterator:
                if frame.kind == pb.PING:
                    yield frames.ack(frame.seq)
                else:
                    await self._accept(frame, context)
        except DecodeError:
            await abort(context, Code.INVALID_ARGUMENT, "not a valid prima.v1.Frame")

    async def _accept(self, frame: pb.Frame, context) -> None:
        try:
            await self.node.accept_frame(frame)
        except Rejected as exc:
            # The predecessor re-opens the stream; the head learns of the request's failure.
            if self.node.windows is not None and frame.request_id and frame.kind == pb.FORWARD:
                await self.node.inbox.put(Work(frame.request_id[:128], pb.ERROR, error=str(exc), code=exc.code,
                                               epoch=frame.epoch))
            await abort(context, exc.code, str(exc))


class ControlService(rpc.ControlServicer):
    def __init__(self, node: Node, stop: asyncio.Event):
        self.node, self.stop = node, stop
        self.serving = asyncio.Semaphore(fetch.MAX_SERVING)  # transfers served at once; more wait their turn
        # one profile at a time: two at once measure each other, and the second finds the first one's cache
        # (the head's live re-planner asks for profiles while prima-ctl may too)
        self.profiling = asyncio.Lock()

    async def Info(self, request, context):
        return self.node.info()

    async def Assign(self, request, context):
        node = self.node
        try:
            windows = Windows(tuple((r.start, r.stop) for r in request.windows), request.ring_layers, request.head)
        except ValueError as exc:
            await abort(context, Code.INVALID_ARGUMENT, str(exc))
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def progress(done: int, total: int, unit: str, fetched: bool = False) -> None:
            update = frames.load_progress(done, total, unit, fetched)
            loop.call_soon_threadsafe(updates.put_nowait, update)

        if not request.model_id:
            await abort(context, Code.INVALID_ARGUMENT, "model_id is required (the ring's model fingerprint)")
        if len(request.ring) > 256 or not all(_is_address(a) for a in request.ring):
            await abort(context, Code.INVALID_ARGUMENT, "ring: at most 256 addresses, each HOST:PORT")
        buffer = request.stream_buffer_layers
        if not 0 <= buffer <= MAX_BUFFER_LAYERS:  # also refuses NaN
            await abort(context, Code.INVALID_ARGUMENT,
                        f"stream_buffer_layers must be in [0, {MAX_BUFFER_LAYERS}], got {buffer}")
        predicted = (request.predicted_ms, request.predicted_tpot_ms)
        if not all(0 <= v < 1e9 for v in predicted):  # also refuses NaN
            await abort(context, Code.INVALID_ARGUMENT, f"predicted_ms and predicted_tpot_ms must be in [0, 1e9) ms, "
                                                        f"got {predicted[0]}, {predicted[1]}")
        if request.max_batch > MAX_REQUESTS or request.micro_batches > MAX_REQUESTS:
            await abort(context, Code.INVALID_ARGUMENT,
                        f"max_batch and micro_batches must be at most {MAX_REQUESTS} (0: the node's default)")
        if request.kv_dtype not in ("", *KV_NAMES):
            await abort(context, Code.INVALID_ARGUMENT,
                        f"kv_dtype must be one of {', '.join(KV_NAMES)} or empty, got {request.kv_dtype[:20]!r}")
        if request.head_address and not _is_address(request.head_address):
            await abort(context, Code.INVALID_ARGUMENT,
                        f"head_address must be HOST:PORT, got {request.head_address[:80]!r}")

        job = Assignment(windows, request.model_id, request.epoch, request.replan, buffer, request.max_batch,
                         request.micro_batches, predicted, (request.kv_dtype, request.ctx))
        place = Place(tuple(request.ring), request.head_address,
                      tuple((r.start, r.stop) for r in request.head_windows), request.standby)

        async def load() -> None:
            try:
                await node.assign(job, place, progress)
            finally:  # after every progress update: the compute thread's callbacks were queued first
                updates.put_nowait(None)

        # The load goes on if the caller goes away: a half-loaded node is worse than an unwatched one.
        task = loop.create_task(load(), name="assign")
        while (update := await updates.get()) is not None:
            yield update
        try:
            task.result()
        except Rejected as exc:
            await abort(context, exc.code, str(exc))
        except (StoreError, ValueError) as exc:
            node.last_error = str(exc)
            await abort(context, Code.FAILED_PRECONDITION, str(exc))
        yield frames.loaded()

    async def Profile(self, request, context):
        node = self.node
        if (node.head and node.head.requests) or (node.shard and node.shard.caches):
            await abort(context, Code.FAILED_PRECONDITION, "requests are in flight; profile an idle ring")
        try:
            async with self.profiling:
                prof = await self._profile(request.refresh)
        except LinkDown as exc:
            await abort(context, Code.UNAVAILABLE, str(exc))
        except OSError as exc:
            await abort(context, Code.FAILED_PRECONDITION, f"profiling failed: {exc}")
        manifest = (node.store.root / MANIFEST).read_text() if node.store else ""  # its store, or its cache
        # its --kv-dtype: the plan prices its KV so (auto: the plan's choice)
        return frames.profile_reply(json.dumps(prof.to_json() | {"kv_dtype": node.cfg.kv_dtype}), manifest)

    async def _profile(self, refresh: bool):
        node = self.node
        # the node's dtype; its first use on this machine times kernels, so on the compute thread
        dtype = await asyncio.get_running_loop().run_in_executor(node.pool, lambda: node.dtype_name)
        prof = await profile_device(node.cfg.name or node.address, node.cfg.model,
                                    node.link if node.peer else None, dtype=dtype,
                                    refresh=refresh, is_head=node.role == "head",
                                    mem_budget=node.mem_budget, compute=node.pool,  # idle, as checked above
                                    cache_path=owner.profile_cache(node.cfg.name or node.address, node.cfg.max_cpu))
        return owner.limited(prof, node.cfg.max_cpu)

    async def SetPeer(self, request, context):
        peer = request.peer
        if not _is_address(peer):
            await abort(context, Code.INVALID_ARGUMENT, f"peer must be HOST:PORT, got {peer[:80]!r}")
        await self.node.set_peer(peer, DRAIN if request.drain else 0.0)
        return frames.SET_PEER_REPLY

    async def Fetch(self, request, context):
        store = self.node.store
        if store is None or request.model_id != store.model_id:
            await abort(context, Code.FAILED_PRECONDITION, "this node does not hold that model"
                        + ("" if store is None else f" (it has {store.model_id[:12]})"))
        try:
            path = fetch.served_path(store, request.name)
        except StoreError as exc:
            await abort(context, Code.NOT_FOUND, str(exc))
        async with self.serving:
            chunks = fetch.read_chunks(path, request.offset)
            try:
                while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                    metrics.observe_served(len(chunk[0]))
                    yield frames.file_chunk(*chunk)
            except (OSError, StoreError) as exc:
                await abort(context, Code.FAILED_PRECONDITION, f"cannot serve {request.name}: {exc}")

    async def Leave(self, request, context):
        head = self.node.head
        if not _is_address(request.address):
            await abort(context, Code.INVALID_ARGUMENT, f"address must be HOST:PORT, got {request.address[:80]!r}")
        if head is None:
            await abort(context, Code.FAILED_PRECONDITION, f"this node is a {self.node.role}, not the ring's head")
        try:
            if request.address in (head.members.head, self.node.address) and head.members.members:
                ring = await handover.hand_over(self.node, forget=True)  # the head leaves: the standby heads
                self.stop.set()
                return frames.leave_reply(ring)
            return frames.leave_reply(await head.members.leave(request.address))
        except Rejected as exc:
            await abort(context, exc.code, str(exc))

    async def Join(self, request, context):
        head = self.node.head
        if not _is_address(request.address):
            await abort(context, Code.INVALID_ARGUMENT, f"address must be HOST:PORT, got {request.address[:80]!r}")
        if head is None:
            await abort(context, Code.FAILED_PRECONDITION, f"this node is a {self.node.role}, not the ring's head "
                                                           f"({self.node.head_address or 'none yet'})")
        try:
            return frames.join_reply(await head.members.join(request.address, request.model_id[:64]))
        except Rejected as exc:
            await abort(context, exc.code, str(exc))
        except grpc.RpcError as exc:
            await abort(context, Code.UNAVAILABLE, f"cannot wire {request.address} in: {exc.code().name}: "
                                                   f"{exc.details()}")

    async def TakeOver(self, request, context):
        if not _is_address(request.lost) or len(request.ring) > 256 or not all(_is_address(a) for a in request.ring):
            await abort(context, Code.INVALID_ARGUMENT, "lost and ring: HOST:PORT addresses (at most 256)")
        try:
            return frames.take_over_reply(await handover.take_over(self.node, request.lost, list(request.ring),
                                                               request.forget))
        except Rejected as exc:
            await abort(context, exc.code, str(exc))

    async def Draft(self, request, context):
        node = self.node
        if node.drafts is None:
            await abort(context, Code.FAILED_PRECONDITION, f"{node.cfg.name or node.address} has no draft model "
                                                           "(prima-node --draft DIR)")
        try:
            return pb.DraftReply(tokens=await run_job(node.pool, node.drafts.draft, request))
        except Rejected as exc:
            await abort(context, exc.code, str(exc))

    async def Shutdown(self, request, context):
        self.stop.set()
        return frames.SHUTDOWN_REPLY


class InferenceService(rpc.InferenceServicer):
    def __init__(self, node: Node):
        self.node = node

    async def Generate(self, request, context):
        node = self.node
        try:
            asked = GenerateRequest.from_wire(request)  # RequestError (a ValueError) names the field out of range
            chars = len(request.prompt) + sum(len(m.content) + len(m.role) for m in request.messages)
            if chars > MAX_PROMPT_CHARS or len(request.request_id) > 128:
                raise ValueError(f"prompt over {MAX_PROMPT_CHARS} characters or request_id over 128")
            head = node.head
            if head is None or node.text is None:
                raise Rejected(Code.FAILED_PRECONDITION, f"this node is a {node.role}, not the ring's head")
            speculate = speculate_params(asked.speculate or head.default_speculate(), asked.draft_tokens, asked.depth)
            params = generate_params(asked, speculate, node.text.tool_family)
            prompt_ids = node.text.request_ids(asked)
            request_id = request.request_id or uuid.uuid4().hex
            start = time.perf_counter()
            stamps = []
            if len(request.resume_tokens) > node.store.config.max_seq_len:
                raise ValueError(f"resume_tokens: over the model's context of {node.store.config.max_seq_len}")
            # Run ahead: the next step goes into the ring while this token is written to the client.
            async for out in run_ahead(head.generate(prompt_ids, params, request_id, list(request.resume_tokens))):
                if isinstance(out, Generation):
                    finished = _finished(out, request_id, start, stamps)
                    metrics.observe_finished(finished)
                    yield frames.finished_event(finished)
                elif isinstance(out, Prefilled):
                    yield frames.prefill_event(out.done, out.total)
                else:
                    stamps.append(time.perf_counter())
                    metrics.observe_token()
                    yield frames.token_event(out.token_id, out.text, out.index, (stamps[-1] - start) * 1e3,
                                             out.logprob, [(t, node.text.decode([t]), lp) for t, lp in out.top],
                                             node.text.decode([out.token_id]) if out.logprob is not None else "",
                                             out.calls)
        except Rejected as exc:
            metrics.observe_error(exc.code)
            await abort(context, exc.code, str(exc))
        except (PromptError, ValueError) as exc:
            metrics.observe_error(Code.INVALID_ARGUMENT)
            await abort(context, Code.INVALID_ARGUMENT, str(exc))
        except RequestFailed as exc:  # RequestCancelled carries CANCELLED
            metrics.observe_error(exc.code)
            await abort(context, exc.code, str(exc))

    async def Cancel(self, request, context):
        head = self.node.head
        return frames.cancel_reply(head is not None and head.requests.cancel(request.request_id))


def _is_address(address: str) -> bool:
    return bool(PEER.fullmatch(address)) and 0 < int(address.rpartition(":")[2]) < 65536


def _finished(gen: Generation, request_id: str, start: float, stamps: list[float]) -> pb.Finished:
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return frames.finished(gen.finish_reason, len(gen.prompt_ids), len(gen.tokens), request_id,
                           (stamps[0] - start) * 1e3 if stamps else 0.0, tpot * 1e3,
                           gen.spec.drafted, gen.spec.accepted, gen.max_tokens, gen.tool_calls,
                           gen.params.speculate.depth if ahead(gen) else 1, gen.trips)
