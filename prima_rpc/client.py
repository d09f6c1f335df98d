"""The Python client: `async for event in client.generate(...)`, and a sync wrapper.

    async with PrimaClient("127.0.0.1:7000") as client:
        async for event in client.generate("Hello!", max_tokens=32):
            print(event.text, end="")
"""

import asyncio
import math
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc

from prima_rpc.channel import aio_channel, metadata
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc


class PrimaError(Exception):
    """A failed call: `code` is the gRPC status (e.g. INVALID_ARGUMENT, UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        message = " ".join(message.split())  # one line, whatever the node wrote
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


# What a GenerateRequest may carry: the one place the CLI, this client and the HTTP API take their ranges from.
MAX_INT32 = 2**31 - 1  # max_tokens and top_k are int32 on the wire
MAX_TOKENS = (1, MAX_INT32)
TEMPERATURE = (0.0, 2.0)  # 0: greedy; OpenAI's range (beyond 2 sampling is noise)
TOP_K = (0, MAX_INT32)  # 0: off
TOP_P = (0.0, 1.0)  # 1: off
SEED = (0, 2**64 - 1)  # uint64 on the wire
MAX_STOP = 16  # stop strings per request (the head's limit)
SPECULATE = ("off", "ngram", "draft")  # speculative decoding: none, prompt lookup, the head's draft model
DRAFT_TOKENS = (1, 16)  # the most tokens drafted per trip


def check_speculate(speculate: str, draft_tokens: int) -> None:
    """ValueError unless a known mode ("" for the head's default) and draft_tokens in range (0 for the default)."""
    if speculate and speculate not in SPECULATE:
        raise ValueError(f"speculate must be one of {', '.join(SPECULATE)}, got {speculate!r}")
    if draft_tokens and not DRAFT_TOKENS[0] <= draft_tokens <= DRAFT_TOKENS[1]:
        raise ValueError(f"draft_tokens must be in [{DRAFT_TOKENS[0]}, {DRAFT_TOKENS[1]}], got {draft_tokens}")


def check_text(value: str, what: str) -> str:
    """`value` if it can go on the wire as UTF-8 (a command line with undecodable bytes cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start].encode("utf-8", "surrogateescape")
        raise ValueError(f"{what} is not valid UTF-8 text (byte 0x{bad.hex()} at character {exc.start}); "
                         "re-encode it as UTF-8") from None
    return value


def check_request(max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
                  stop: tuple[str, ...]) -> None:
    """ValueError naming the first argument the head would refuse."""
    for name, value, (lo, hi) in (("max_tokens", max_tokens, MAX_TOKENS), ("temperature", temperature, TEMPERATURE),
                                  ("top_k", top_k, TOP_K), ("top_p", top_p, TOP_P)):
        if not (isinstance(value, int | float) and math.isfinite(value) and lo <= value <= hi):
            raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value}" if isinstance(lo, float)
                             else f"{name} must be in [{lo}, {hi}], got {value}")
    if seed is not None and not SEED[0] <= seed <= SEED[1]:
        raise ValueError(f"seed must be in [0, 2**64 - 1], got {seed}")
    if len(stop) > MAX_STOP or not all(stop):
        raise ValueError(f"stop: up to {MAX_STOP} non-empty strings, got {len(stop)}")
    for s in stop:
        check_text(s, "a stop string")


@dataclass(frozen=True)
class Token:
    token_id: int
    text: str
    index: int
    elapsed_ms: float


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


def _request(prompt: str, messages, max_tokens, temperature, top_k, top_p, seed, stop, raw, request_id,
             speculate="", draft_tokens=0):
    return pb.GenerateRequest(
        prompt=prompt, messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()],
        raw=raw, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop=list(stop), request_id=request_id, speculate=speculate, draft_tokens=draft_tokens)


class PrimaClient:
    def __init__(self, address: str, token: str | None = None, timeout: float | None = None):
        # timeout: a deadline for a whole call (None: the head's per-step deadline still ends a stuck ring)
        self.address, self.token, self.timeout = address, token, timeout
        self._channel = aio_channel(address)
        self._inference = rpc.InferenceStub(self._channel)

    async def __aenter__(self) -> "PrimaClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, prompt: str = "", *, messages: list[dict] | None = None, max_tokens: int = 128,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop: tuple[str, ...] = (), raw: bool = False,
                       request_id: str = "", speculate: str = "", draft_tokens: int = 0
                       ) -> AsyncIterator[Token | Finished]:
        """Token events as the head produces them, then one Finished; PrimaError on failure (arguments out of
        range: INVALID_ARGUMENT before anything is sent). speculate: "off" | "ngram" ("": the head's default),
        draft_tokens: the most tokens drafted per trip (0: the default)."""
        try:
            check_request(max_tokens, temperature, top_k, top_p, seed, tuple(stop))
            check_speculate(speculate, draft_tokens)
            check_text(prompt, "the prompt")
            for m in messages or ():
                check_text(m["content"], "a message")
        except ValueError as exc:
            raise PrimaError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        req = _request(prompt, messages, max_tokens, temperature, top_k, top_p, seed, stop, raw, request_id,
                       speculate, draft_tokens)
        call = self._inference.Generate(req, metadata=metadata(self.token), timeout=self.timeout)
        try:
            async for event in call:
                if event.HasField("token"):
                    t = event.token
                    yield Token(t.token_id, t.text, t.index, t.elapsed_ms)
                else:
                    f = event.finished
                    yield Finished(f.finish_reason, f.prompt_tokens, f.completion_tokens, f.ttft_ms, f.tpot_ms,
                                   f.request_id, f.drafted, f.accepted)
        except grpc.aio.AioRpcError as exc:
            raise PrimaError(exc.code(), self._explain(exc)) from None
        finally:
            call.cancel()

    def _explain(self, exc: grpc.aio.AioRpcError) -> str:
        """The node's message; when no node answered, which address could not be reached."""
        details = exc.details() or exc.code().name
        if exc.code() == grpc.StatusCode.UNAVAILABLE and \
                self._channel.get_state() != grpc.ChannelConnectivity.READY:
            return f"cannot reach node {self.address}: {details}"
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            return f"{self.address} refused the token: {details}"
        return details

    async def cancel(self, request_id: str) -> bool:
        reply = await rpc.InferenceStub(self._channel).Cancel(pb.CancelRequest(request_id=request_id),
                                                              metadata=metadata(self.token))
        return reply.found


class SyncClient:
    """The same client for code without an event loop: a background loop thread drives it."""

    def __init__(self, address: str, token: str | None = None, timeout: float | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="prima-client")
        self._thread.start()
        self._client = asyncio.run_coroutine_threadsafe(self._make(address, token, timeout), self._loop).result()

    @staticmethod
    async def _make(address, token, timeout) -> PrimaClient:
        return PrimaClient(address, token, timeout)

    def generate(self, prompt: str = "", **kwargs) -> Iterator[Token | Finished]:
        events: queue.Queue = queue.Queue()
        done = object()

        async def pump():
            try:
                async for event in self._client.generate(prompt, **kwargs):
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
