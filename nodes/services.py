"""Thin gRPC servicers over the node actor: validate, translate errors to statuses, stream."""

import asyncio
import json
import re
import time
import uuid

import grpc
from google.protobuf.message import DecodeError

from nodes import metrics
from nodes.config import MANIFEST, StoreError
from nodes.generation import GenerateParams, Generation
from nodes.head import RequestFailed
from nodes.link import LinkDown
from nodes.node import Node
from nodes.prefetch import MAX_BUFFER_LAYERS
from nodes.profiler import profile_device
from nodes.routing import Windows
from nodes.sampling import SamplingParams
from nodes.text import PromptError
from nodes.work import Rejected, Work
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc

MAX_PROMPT_CHARS = 1 << 20
PEER = re.compile(r"(?:[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}")  # host:port or [v6]:port


async def abort(context, code: str, message: str):
    await context.abort(getattr(grpc.StatusCode, code), message)


class RingService(rpc.RingServicer):
    def __init__(self, node: Node):
        self.node = node

    async def Stream(self, request_iterator, context):
        try:
            async for frame in request_iterator:
                if frame.kind == pb.PING:
                    yield pb.Ack(seq=frame.seq)
                else:
                    await self._accept(frame, context)
        except DecodeError:
            await abort(context, "INVALID_ARGUMENT", "not a valid prima.v1.Frame")

    async def _accept(self, frame: pb.Frame, context) -> None:
        try:
            await self.node.accept_frame(frame)
        except Rejected as exc:
            # The predecessor re-opens the stream; the head learns of the request's failure.
            if self.node.windows is not None and frame.request_id and frame.kind == pb.FORWARD:
                await self.node.inbox.put(Work(frame.request_id[:128], pb.ERROR, error=str(exc), epoch=frame.epoch))
            await abort(context, exc.code, str(exc))


class ControlService(rpc.ControlServicer):
    def __init__(self, node: Node, stop: asyncio.Event):
        self.node, self.stop = node, stop

    async def Info(self, request, context):
        return self.node.info()

    async def Assign(self, request, context):
        node = self.node
        try:
            windows = Windows(tuple((r.start, r.stop) for r in request.windows), request.ring_layers, request.head)
        except ValueError as exc:
            await abort(context, "INVALID_ARGUMENT", str(exc))
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def progress(done: int, total: int, unit: str) -> None:
            update = pb.LoadProgress(done_bytes=done, total_bytes=total, unit=unit)
            loop.call_soon_threadsafe(updates.put_nowait, update)

        if not request.model_id:
            await abort(context, "INVALID_ARGUMENT", "model_id is required (the ring's model fingerprint)")
        if len(request.ring) > 256 or any(len(a) > 255 for a in request.ring):
            await abort(context, "INVALID_ARGUMENT", "ring: at most 256 addresses of up to 255 characters")
        buffer = request.stream_buffer_layers
        if not 0 <= buffer <= MAX_BUFFER_LAYERS:  # also refuses NaN
            await abort(context, "INVALID_ARGUMENT",
                        f"stream_buffer_layers must be in [0, {MAX_BUFFER_LAYERS}], got {buffer}")
        task = loop.create_task(node.assign(windows, request.model_id, progress, request.epoch, request.replan,
                                            list(request.ring), buffer), name="assign")
        while not (task.done() and updates.empty()):
            getter = loop.create_task(updates.get())
            await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            else:
                getter.cancel()
        try:
            task.result()
        except Rejected as exc:
            await abort(context, exc.code, str(exc))
        except (StoreError, ValueError) as exc:
            node.last_error = str(exc)
            await abort(context, "FAILED_PRECONDITION", str(exc))
        yield pb.LoadProgress(ready=True)

    async def Profile(self, request, context):
        node = self.node
        if node.requests or (node.shard and node.shard.caches):
            await abort(context, "FAILED_PRECONDITION", "requests are in flight; profile an idle ring")
        try:
            prof = await profile_device(node.cfg.name or node.address, node.cfg.model,
                                        node.link if node.peer else None, dtype=node.cfg.dtype,
                                        refresh=request.refresh, is_head=node.role == "head",
                                        mem_budget=node.cfg.mem_budget)
        except LinkDown as exc:
            await abort(context, "UNAVAILABLE", str(exc))
        except OSError as exc:
            await abort(context, "FAILED_PRECONDITION", f"profiling failed: {exc}")
        manifest = (node.cfg.model / MANIFEST).read_text() if node.cfg.model else ""
        return pb.ProfileReply(json=json.dumps(prof.to_json()), manifest=manifest)

    async def SetPeer(self, request, context):
        peer = request.peer
        port = peer.rpartition(":")[2]
        if not PEER.fullmatch(peer) or not (0 < int(port) < 65536):
            await abort(context, "INVALID_ARGUMENT", f"peer must be HOST:PORT, got {peer[:80]!r}")
        self.node.set_peer(peer)
        return pb.SetPeerReply()

    async def Shutdown(self, request, context):
        self.stop.set()
        return pb.ShutdownReply()


class InferenceService(rpc.InferenceServicer):
    def __init__(self, node: Node):
        self.node = node

    async def Generate(self, request, context):
        node = self.node
        try:
            params = GenerateParams(
                max_tokens=request.max_tokens, stop=tuple(request.stop),
                sampling=SamplingParams(request.temperature, request.top_k, request.top_p or 1.0,
                                        request.seed if request.HasField("seed") else None))
            chars = len(request.prompt) + sum(len(m.content) + len(m.role) for m in request.messages)
            if chars > MAX_PROMPT_CHARS or len(request.request_id) > 128:
                raise ValueError(f"prompt over {MAX_PROMPT_CHARS} characters or request_id over 128")
            if node.text is None:
                raise Rejected("FAILED_PRECONDITION", f"this node is a {node.role}, not the ring's head")
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            prompt_ids = node.text.prompt_ids(request.prompt, messages or None, request.raw)
            request_id = request.request_id or uuid.uuid4().hex
            start = time.perf_counter()
            stamps = []
            async for out in node.generate(prompt_ids, params, request_id):
                if isinstance(out, Generation):
                    finished = _finished(out, request_id, start, stamps)
                    metrics.observe_finished(finished)
                    yield pb.GenerateEvent(finished=finished)
                else:
                    stamps.append(time.perf_counter())
                    metrics.observe_token()
                    yield pb.GenerateEvent(token=pb.TokenEvent(token_id=out.token_id, text=out.text, index=out.index,
                                                               elapsed_ms=(stamps[-1] - start) * 1e3))
        except Rejected as exc:
            metrics.observe_error(exc.code)
            await abort(context, exc.code, str(exc))
        except (PromptError, ValueError) as exc:
            metrics.observe_error("INVALID_ARGUMENT")
            await abort(context, "INVALID_ARGUMENT", str(exc))
        except RequestFailed as exc:
            code = "CANCELLED" if str(exc) == "cancelled" else "UNAVAILABLE"
            metrics.observe_error(code)
            await abort(context, code, str(exc))

    async def Cancel(self, request, context):
        return pb.CancelReply(found=self.node.cancel(request.request_id))


def _finished(gen: Generation, request_id: str, start: float, stamps: list[float]) -> pb.Finished:
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return pb.Finished(finish_reason=gen.finish_reason, prompt_tokens=len(gen.prompt_ids),
                       completion_tokens=len(gen.tokens), request_id=request_id,
                       ttft_ms=(stamps[0] - start) * 1e3 if stamps else 0.0, tpot_ms=tpot * 1e3)
