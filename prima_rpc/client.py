"""The Python client: `async for event in client.generate(...)` (or `client.stream(GenerateRequest(...))`), and a
sync wrapper. Given several members of the ring, a stream its head breaks is resumed on the new head.

    async with PrimaClient("127.0.0.1:7000") as client:
        async for event in client.generate("Hello!", max_tokens=32):
            print(event.text, end="")
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

import grpc

from prima_rpc.channel import PING_TIMEOUT_S, aio_channel, metadata
from prima_rpc.request import GenerateRequest, Message, RequestError, ToolCall, ToolCallDelta
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc


class PrimaError(Exception):
    """A failed call: `code` is the gRPC status (e.g. INVALID_ARGUMENT, UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        message = " ".join(message.split())  # one line, whatever the node wrote
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class Token:
    token_id: int
    text: str
    index: int
    elapsed_ms: float
    logprob: float | None = None  # with logprobs asked: log p of this token, and its own text (`text` may hold
    token: str = ""  # it back, e.g. the start of a tool call)
    top_logprobs: tuple[tuple[int, str, float], ...] = ()  # (token id, text, log p), likeliest first
    tool_calls: tuple[ToolCallDelta, ...] = ()  # with tools: what this token adds to the calls being generated


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    tpot_ms: float
    request_id: str
    drafted: int = 0  # speculative decoding: tokens drafted, and those the target model accepted
    accepted: int = 0
    max_tokens: int = 0  # what it could emit: its max_tokens capped to what the context leaves (0: an old head)
    tool_calls: tuple[ToolCall, ...] = ()  # with finish_reason "tool_calls"
    depth: int = 1  # speculative windows in flight it ran with (1: one at a time)
    trips: int = 0  # ring trips its tokens took (0: an old head)


@dataclass(frozen=True)
class Prefill:
    """A long prompt's progress through the ring (stream(..., prefill=True) only): done of total tokens."""

    done: int
    total: int


CANCEL_S = 5.0  # the head answers Cancel from memory
RESUME_S = 30.0  # how long a client that knows several members looks for a new head after its head is lost
RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)  # lost, or not (yet) the head
log = logging.getLogger(__name__)


def _request(prompt: str = "", messages: Iterable[dict] | None = None, **fields) -> GenerateRequest:
    """A GenerateRequest from keywords (messages as {"role", "content"} dicts); INVALID_ARGUMENT for what the head
    would refuse."""
    try:
        return GenerateRequest(prompt, tuple(Message(m["role"], m["content"]) for m in messages or ()), **fields)
    except RequestError as exc:
        raise PrimaError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


class PrimaClient:
    def __init__(self, address: str | Iterable[str], token: str | None = None, timeout: float | None = None):
        """address: the head, or several members of the ring (any order): a stream the head breaks is then
        resumed on the new head, the tokens already given replayed, so the answer goes on as if nothing broke.
        timeout: a deadline for a whole call (None: the head's per-step deadline still ends a stuck ring)."""
        self.addresses = [address] if isinstance(address, str) else list(dict.fromkeys(address))
        if not self.addresses:
            raise ValueError("PrimaClient needs at least one address")
        self.address, self.token, self.timeout = self.addresses[0], token, timeout
        self._channels = {a: aio_channel(a) for a in self.addresses}
        self._metadata = metadata(token)

    async def __aenter__(self) -> "PrimaClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    def generate(self, prompt: str = "", *, messages: Iterable[dict] | None = None,
                 **fields) -> AsyncIterator[Token | Finished]:
        """stream() of the GenerateRequest these keywords make: max_tokens, temperature, top_k, top_p, seed, stop,
        raw, request_id, speculate ("off" | "ngram" | "draft"; "": the head's default), draft_tokens and depth
        (speculative windows in flight; 0: the default). Arguments out of range: PrimaError INVALID_ARGUMENT here,
        before anything is sent."""
        return self.stream(_request(prompt, messages, **fields))

    async def stream(self, request: GenerateRequest, prefill: bool = False) -> AsyncIterator[Token | Finished]:
        """Token events as the head produces them, then one Finished; PrimaError on failure. prefill: a long
        prompt's Prefill events before its tokens too. With several addresses, a lost head (or a member that is
        not the head) sends the request on to the ring's head."""
        given: list[int] = []  # token ids streamed so far: a resumed request replays them
        deadline = None  # from the first failure: how long the ring may take to fail over
        found = ""  # the head _find_head found: if it refuses the request too, that is its answer
        while True:
            try:
                async for event in self._stream_from(self.address, request, given, prefill):
                    if isinstance(event, Token):
                        given.append(event.token_id)
                    yield event
                return
            except PrimaError as exc:
                if len(self.addresses) < 2 or exc.code not in RESUMABLE or \
                        (self.address == found and exc.code == grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                deadline = deadline or time.monotonic() + RESUME_S
                broken, self.address = self.address, await self._find_head(exc, deadline)
                found = self.address
                log.warning("prima: the request to %s failed (%s); resumed on the head %s after %d tokens",
                            broken, exc, self.address, len(given))

    async def _stream_from(self, address: str, request: GenerateRequest,
                           given: list[int], prefill: bool) -> AsyncIterator[Token | Finished]:
        wire = request.to_wire()
        wire.resume_tokens.extend(given)
        call = rpc.InferenceStub(self._channels[address]).Generate(wire, metadata=self._metadata,
                                                                   timeout=self.timeout)
        try:
            async for event in call:
                if event.HasField("token"):
                    t = event.token
                    yield Token(t.token_id, t.text, t.index, t.elapsed_ms,
                                t.logprob if request.logprobs or request.top_logprobs else None, t.token,
                                tuple((p.token_id, p.text, p.logprob) for p in t.top_logprobs),
                                tuple(ToolCallDelta(c.index, c.id, c.name, c.arguments) for c in t.tool_calls))
                elif event.HasField("finished"):
                    f = event.finished
                    yield Finished(f.finish_reason, f.prompt_tokens, f.completion_tokens, f.ttft_ms, f.tpot_ms,
                                   f.request_id, f.drafted, f.accepted, f.max_tokens,
                                   tuple(ToolCall(c.id, c.name, c.arguments) for c in f.tool_calls),
                                   f.depth or 1, f.trips)
                elif event.HasField("prefill") and prefill:
                    yield Prefill(event.prefill.done, event.prefill.total)
        except grpc.aio.AioRpcError as exc:
            raise PrimaError(exc.code(), self._explain(address, exc)) from None
        finally:
            call.cancel()

    async def _find_head(self, failure: PrimaError, deadline: float) -> str:
        """The member that is the ring's head now (asked of every known address, then of the heads they name),
        waited for until `deadline` while the ring fails over; else `failure` is raised."""
        while time.monotonic() < deadline:
            named = []
            for address in self.addresses:
                info = await self._info(address)
                if info is not None and info.role == "head" and info.loaded:
                    return address
                if info is not None and info.head and info.head not in self.addresses + named:
                    named.append(info.head)
            for address in named:
                self._channels.setdefault(address, aio_channel(address))
                info = await self._info(address)
                if info is not None and info.role == "head" and info.loaded:
                    return address
            await asyncio.sleep(0.3)
        raise failure

    async def _info(self, address: str) -> pb.NodeInfo | None:
        try:
            return await rpc.ControlStub(self._channels[address]).Info(pb.InfoRequest(), metadata=self._metadata,
                                                                       timeout=2.0)
        except grpc.aio.AioRpcError:
            return None

    def _explain(self, address: str, exc: grpc.aio.AioRpcError) -> str:
        """The node's message; when no node answered, which address could not be reached."""
        details = exc.details() or exc.code().name
        if exc.code() == grpc.StatusCode.UNAVAILABLE and "ping timeout" in details:  # keepalive closed it
            return f"node {address} stopped answering (a keepalive ping went unanswered for {PING_TIMEOUT_S} s)"
        if exc.code() == grpc.StatusCode.UNAVAILABLE and \
                self._channels[address].get_state() != grpc.ChannelConnectivity.READY:
            return f"cannot reach node {address}: {details}"
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            return f"{address} refused the token: {details}"
        return details

    async def cancel(self, request_id: str) -> bool:
        stub = rpc.InferenceStub(self._channels[self.address])
        reply = await stub.Cancel(pb.CancelRequest(request_id=request_id), metadata=self._metadata,
                                  timeout=CANCEL_S)
        return reply.found


class SyncClient:
    """The same client for code without an event loop: a background loop thread drives it."""

    def __init__(self, address: str | Iterable[str], token: str | None = None, timeout: float | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="prima-client")
        self._thread.start()
        self._client = asyncio.run_coroutine_threadsafe(self._make(address, token, timeout), self._loop).result()

    @staticmethod
    async def _make(address, token, timeout) -> PrimaClient:
        return PrimaClient(address, token, timeout)

    def generate(self, prompt: str = "", *, messages: Iterable[dict] | None = None,
                 **fields) -> Iterator[Token | Finished]:
        """PrimaClient.generate's keywords; PrimaError INVALID_ARGUMENT here for arguments out of range."""
        return self.stream(_request(prompt, messages, **fields))

    def stream(self, request: GenerateRequest) -> Iterator[Token | Finished]:
        events: queue.Queue = queue.Queue()
        done = object()

        async def pump():
            try:
                async for event in self._client.stream(request):
                    events.put(event)
            except Exception as exc:  # handed to the caller's thread below
                events.put(exc)
            events.put(done)

        asyncio.run_coroutine_threadsafe(pump(), self._loop)
        while (event := events.get()) is not done:
            if isinstance(event, Exception):
                raise event
            yield event

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
