"""An OpenAI-compatible HTTP API in front of the ring's head: chat and text completions, models, SSE streams.

Served by aiohttp.web: one well-kept asyncio package that is both server and streaming writer, so the
gRPC aio channel to the head lives on the same event loop, and `handler_cancellation` cancels a request's
handler (and with it the gRPC call, which frees the ring's KV caches) as soon as its client disconnects.
"""

import asyncio
import contextlib
import hmac
import json
import math
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog
from aiohttp import web

from prima_rpc.channel import aio_channel, metadata
from prima_rpc.client import Finished, PrimaClient, PrimaError, Token
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc

log = structlog.get_logger("prima.openai_api")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 503,  # the node is not (yet) a head: the ring is not started
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}  # any other status: 500
MAX_INT32 = 2**31 - 1  # max_tokens is an int32 on the wire
MAX_STOP = 16  # the head's limit on stop strings
MAX_BODY_BYTES = 8 << 20  # the head takes prompts up to 1 Mi characters
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields whose effect the ring cannot give, and the values that ask for nothing.
UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "logit_bias": (None, {}), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "response_format": (None, {"type": "text"}),
}


@dataclass(frozen=True)
class ApiConfig:
    head: str  # HOST:PORT of the ring's head
    token: str | None = None  # the cluster secret: required as the Bearer key, passed on to the head
    default_max_tokens: int = 1024  # for requests without max_tokens (the head reserves KV for all of them)


class ApiError(Exception):
    """A request the API answers with `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_grpc(cls, exc: PrimaError) -> "ApiError":
        return cls(HTTP_STATUS.get(exc.code, 500), exc.message, code=exc.code.name.lower())

    def body(self) -> dict:
        kind = ("server_error" if self.status >= 500 else "rate_limit_error" if self.status == 429
                else "authentication_error" if self.status == 401 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


# ---------------------------------------------------------------- requests: JSON body -> GenerateCall


@dataclass(frozen=True)
class GenerateCall:
    """One validated completion request: the arguments of PrimaClient.generate and how to answer."""

    chat: bool  # /v1/chat/completions (messages, chat template) or /v1/completions (raw prompt)
    prompt: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None

    def generate_kwargs(self) -> dict:
        return dict(prompt=self.prompt, messages=[{"role": r, "content": c} for r, c in self.messages] or None,
                    raw=not self.chat, max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=self.stop)


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(400, f"Invalid '{name}': expected an integer in [{lo}, {hi}], got {_show(value)}.", name,
                       "invalid_value")
    return value


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or not lo <= value <= hi):
        raise ApiError(400, f"Invalid '{name}': expected a number in [{lo:g}, {hi:g}], got {_show(value)}.", name,
                       "invalid_value")
    return float(value)


def _text(value, param: str) -> str:
    """A string, or OpenAI's content parts [{"type": "text", "text": ...}] joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return "\n".join(p["text"] for p in value)
    raise ApiError(400, f"Invalid '{param}': expected a string or text content parts, got {_show(value)}.", param,
                   "invalid_type")


def _messages(body: dict) -> tuple[tuple[str, str], ...]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"Invalid 'messages': expected a non-empty array, got {_show(messages)}.", "messages",
                       "invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"Invalid '{where}': expected an object, got {_show(m)}.", where, "invalid_type")
        if m.get("role") not in ROLES:
            raise ApiError(400, f"Invalid '{where}.role': expected one of {', '.join(ROLES)}, got "
                           f"{_show(m.get('role'))}.", f"{where}.role", "invalid_value")
        out.append((ROLES[m["role"]], _text(m.get("content"), f"{where}.content")))
    return tuple(out)


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, f"Invalid 'prompt': expected one non-empty string, got {_show(prompt)}.", "prompt",
                       "invalid_value")
    return prompt


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, f"Invalid 'stop': expected a non-empty string or up to {MAX_STOP} of them, got "
                       f"{_show(body.get('stop'))}.", "stop", "invalid_value")
    return tuple(stop)


def parse_request(body, chat: bool, default_max_tokens: int) -> GenerateCall:
    """Validate a decoded JSON body of /v1/chat/completions (chat) or /v1/completions; ApiError(400) says why not."""
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object, got {_show(body)}.")
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise ApiError(400, f"Unsupported value of '{name}': {_show(body[name])} (this server takes only "
                           f"{' or '.join(_show(a) for a in allowed if a is not None)}).", name, "unsupported_value")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"Invalid 'model': expected a string, got {_show(model)}.", "model", "invalid_type")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, f"Invalid 'stream': expected a boolean, got {_show(stream)}.", "stream", "invalid_type")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or not isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "Invalid 'stream_options': an object {\"include_usage\": bool}, only with stream true.",
                       "stream_options", "invalid_value")
    max_tokens = _integer(body, "max_completion_tokens", 1, MAX_INT32) or _integer(body, "max_tokens", 1, MAX_INT32)
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)  # OpenAI's default is 1: sampling
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)
    return GenerateCall(
        chat=chat, prompt="" if chat else _prompt(body), messages=_messages(body) if chat else (),
        max_tokens=max_tokens or default_max_tokens,
        temperature=0.0 if top_p == 0.0 else temperature,  # top_p 0 keeps one token; on the wire 0 means off
        top_p=top_p, top_k=_integer(body, "top_k", 0, MAX_INT32) or 0,
        seed=None if seed is None else seed % 2**64, stop=_stop(body), stream=stream,
        include_usage=bool(options and options.get("include_usage")), model=model)


# ---------------------------------------------------------------- answers: events -> OpenAI objects


def usage(done: Finished) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def choice(call: GenerateCall, text: str | None, finish_reason: str | None, chunk: bool) -> dict:
    if not call.chat:
        body = {"text": text or ""}
    elif chunk:
        body = {"delta": {"content": text} if text is not None else {}}
    else:
        body = {"message": {"role": "assistant", "content": text}}
    return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}


def envelope(call: GenerateCall, completion_id: str, created: int, model: str, choices: list[dict],
             chunk: bool) -> dict:
    kind = "text_completion" if not call.chat else "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": completion_id, "object": kind, "created": created, "model": model, "choices": choices}


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


# ---------------------------------------------------------------- the app


class Api:
    """The HTTP handlers: one PrimaClient (one channel to the head) shared by every request."""

    def __init__(self, config: ApiConfig):
        self.config = config
        self.created = int(time.time())
        self._model: str | None = None

    async def startup(self, app: web.Application) -> None:
        # The aio channels belong to the serving event loop, so they are made on it.
        self.client = PrimaClient(self.config.head, self.config.token)
        self._control_channel = aio_channel(self.config.head)
        self.control = rpc.ControlStub(self._control_channel)

    async def cleanup(self, app: web.Application) -> None:
        await self.client.close()
        await self._control_channel.close()

    async def model_name(self) -> str:
        """The head's model name from its Info; asked once (a node's model is fixed when it starts)."""
        if self._model is None:
            try:
                info = await self.control.Info(pb.InfoRequest(), metadata=metadata(self.config.token), timeout=5)
            except grpc.aio.AioRpcError as exc:
                failed = PrimaError(exc.code(), f"the head {self.config.head}: {exc.details()}")
                raise ApiError.from_grpc(failed) from None
            if not info.model_name and not info.model_id:
                return "none"
            self._model = info.model_name or info.model_id[:16]
        return self._model

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "prima-rpc"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card(await self.model_name())]})

    async def model(self, request: web.Request) -> web.Response:
        name = await self.model_name()
        if request.match_info["model"] != name:
            raise ApiError(404, f"The model '{request.match_info['model']}' does not exist; this ring serves "
                           f"'{name}'.", "model", "model_not_found")
        return web.json_response(self._model_card(name))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            raise ApiError(400, f"We could not parse the JSON body of your request: {exc}.") from None
        call = parse_request(body, chat, self.config.default_max_tokens)
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        model = await self.model_name()
        bound = log.bind(request_id=completion_id, path=request.path, stream=call.stream)
        try:
            # aclosing: a disconnect (the handler is cancelled) or a failed write closes the generator at
            # once, and its `finally` cancels the gRPC call, so the head releases the request.
            async with contextlib.aclosing(self.client.generate(**call.generate_kwargs(),
                                                                request_id=completion_id)) as events:
                if call.stream:
                    return await self._stream(request, call, completion_id, model, events, bound)
                text, done = [], None
                async for event in events:
                    if isinstance(event, Token):
                        text.append(event.text)
                    else:
                        done = event
        except (asyncio.CancelledError, ConnectionResetError):
            bound.info("client disconnected; request cancelled")
            raise
        except PrimaError as exc:
            bound.warning("request failed", code=exc.code.name, message=exc.message)
            raise ApiError.from_grpc(exc) from None
        bound.info("completed", **usage(done))
        answer = envelope(call, completion_id, int(time.time()), model,
                          [choice(call, "".join(text), done.finish_reason, chunk=False)], chunk=False)
        return web.json_response({**answer, "usage": usage(done)})

    async def _stream(self, request: web.Request, call: GenerateCall, completion_id: str, model: str, events,
                      bound) -> web.StreamResponse:
        """Server-sent events; the HTTP status is sent with the first event, so failures before it keep theirs."""
        created, response, done = int(time.time()), None, None

        def chunk(text: str | None, finish_reason: str | None = None) -> dict:
            obj = envelope(call, completion_id, created, model, [choice(call, text, finish_reason, chunk=True)],
                           chunk=True)
            return {**obj, "usage": None} if call.include_usage else obj

        try:
            async for event in events:
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                    await response.prepare(request)
                    if call.chat:
                        first = chunk("")
                        first["choices"][0]["delta"]["role"] = "assistant"
                        await response.write(sse(first))
                if isinstance(event, Token):
                    if event.text:
                        await response.write(sse(chunk(event.text)))
                else:
                    done = event
                    await response.write(sse(chunk(None if call.chat else "", event.finish_reason)))
                    if call.include_usage:
                        final = envelope(call, completion_id, created, model, [], chunk=True)
                        await response.write(sse({**final, "usage": usage(event)}))
        except PrimaError as exc:
            if response is None:
                raise
            bound.warning("stream failed", code=exc.code.name, message=exc.message)
            await response.write(sse(ApiError.from_grpc(exc).body()))
        await response.write(sse(b"[DONE]"))
        await response.write_eof()
        if done is not None:
            bound.info("completed", **usage(done))
        return response


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:  # no such route, wrong method, body too large
        if exc.status < 400:
            raise
        response = ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}").response()
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response


def bearer_auth(token: str):
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
            raise ApiError(401, "Missing or incorrect API key: send 'Authorization: Bearer <the ring's token>'.",
                           code="invalid_api_key")
        return await handler(request)

    return auth


def make_app(config: ApiConfig) -> web.Application:
    api = Api(config)
    middlewares = [openai_errors] + ([bearer_auth(config.token)] if config.token else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app.on_startup.append(api.startup)
    app.on_cleanup.append(api.cleanup)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model:.+}", api.model)
    return app


async def serve(config: ApiConfig, host: str = "127.0.0.1", port: int = 8000,
                ready: Callable[[str], None] = lambda url: None, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (default: until SIGINT or SIGTERM); `ready` gets the base URL, e.g. .../v1."""
    runner = web.AppRunner(make_app(config), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        bound_host, bound_port = runner.addresses[0][:2]
        ready(f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}/v1")
        await stop.wait()
    finally:
        await runner.cleanup()
