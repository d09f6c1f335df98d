"""An OpenAI-compatible HTTP API in front of the ring's head: chat and text completions, models, SSE streams.

Served by aiohttp.web: one well-kept asyncio package that is both server and streaming writer, so the
gRPC aio channel to the head lives on the same event loop, and `handler_cancellation` cancels a request's
handler (and with it the gRPC call, which frees the ring's KV caches) as soon as its client disconnects.
"""

import asyncio
import contextlib
import hmac
import json
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import structlog
from aiohttp import web

from prima_rpc.app import anthropic_api, anthropic_request, ollama_api, ollama_request, web_page
from prima_rpc.app.dialect_io import json_body
from prima_rpc.app.openai_choices import Answer, ChoiceStream, merged, seeded, whole_choice
from prima_rpc.app.openai_request import MAX_BODY_BYTES, ApiError, GenerateCall, parse_request
from prima_rpc.client import Finished, PrimaClient, PrimaError, Token
from prima_rpc.control import AioControl

log = structlog.get_logger("prima.openai_api")


@dataclass(frozen=True)
class ApiConfig:
    head: str  # HOST:PORT of the ring's head
    token: str | None = None  # the cluster secret: required as the Bearer key, passed on to the head
    default_max_tokens: int = 1024  # for requests without max_tokens (the head reserves KV for all of them)
    default_temperature: float | None = None  # for requests without one (None: the model's sampling)
    members: tuple[str, ...] = ()  # other members (--node A,B,C): a stream the head breaks resumes on the new head


def model_id(name: str) -> str:
    """A model name as an id clients can put in a URL: no spaces."""
    return "-".join(name.split()) or "none"


def usage(done: list[Finished]) -> dict:
    """Of all the choices: the prompt counted once (OpenAI's way), the completions added up."""
    prompt, completion = done[0].prompt_tokens, sum(d.completion_tokens for d in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "drafted": sum(d.drafted for d in done), "accepted": sum(d.accepted for d in done)}


def envelope(call: GenerateCall, completion_id: str, created: int, model: str, choices: list[dict],
             chunk: bool) -> dict:
    kind = "text_completion" if not call.chat else "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": completion_id, "object": kind, "created": created, "model": model, "choices": choices}


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


# ---------------------------------------------------------------- the app


class Api:
    """The HTTP handlers: one PrimaClient and one Control handle on the head, shared by every request."""

    def __init__(self, config: ApiConfig):
        self.config = config
        self.created = int(time.time())
        self._model: str | None = None

    async def startup(self, app: web.Application) -> None:
        # The aio channels belong to the serving event loop, so they are made on it.
        self.client = PrimaClient([self.config.head, *self.config.members], self.config.token)
        self.head = AioControl(self.config.head, self.config.token)

    async def cleanup(self, app: web.Application) -> None:
        await self.client.close()
        await self.head.close()

    async def model_name(self) -> str:
        """The head's model name from its Info; asked once (a node's model is fixed when it starts)."""
        if self._model is None:
            try:
                info = await self.head.info()
            except grpc.aio.AioRpcError as exc:
                raise ApiError.from_grpc(PrimaError(exc.code(), exc.details()), self.config.head) from None
            if not info.model_name and not info.model_id:
                return "none"
            self._model = model_id(info.model_name or info.model_id[:16])
        return self._model

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "prima-rpc"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card(await self.model_name())]})

    async def model(self, request: web.Request) -> web.Response:
        """Any name is the ring's model, as for completions (clients ask for "prima", "gpt-4o", ...)."""
        await self.model_name()  # the head answers, or the same error as a completion would get
        return web.json_response(self._model_card(request.match_info["model"]))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await json_body(request)
        call = parse_request(body, chat, self.config.default_max_tokens, self.config.default_temperature)
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        model = await self.model_name()
        bound = log.bind(request_id=completion_id, path=request.path, stream=call.stream)
        requests = [seeded(replace(call.request, request_id=f"{completion_id}-{i}" if call.n > 1 else completion_id),
                           i) for i in range(call.n)]
        logprobs = call.request.logprobs or call.request.top_logprobs > 0
        try:
            # aclosing: a disconnect (the handler is cancelled) or a failed write closes the generator at
            # once, and its `finally` cancels the gRPC calls, so the head releases the requests.
            async with contextlib.aclosing(merged(requests, self.client.stream)) as events:
                if call.stream:
                    return await self._stream(request, call, completion_id, model, events, bound, logprobs)
                answers = [Answer() for _ in requests]
                async for i, event in events:
                    if isinstance(event, Token):
                        answers[i].tokens.append(event)
                    else:
                        answers[i].done = event
        except (asyncio.CancelledError, ConnectionResetError):
            bound.info("client disconnected; request cancelled")
            raise
        except PrimaError as exc:
            bound.warning("request failed", code=exc.code.name, message=exc.message)
            raise ApiError.from_grpc(exc) from None
        done = [a.done for a in answers]
        bound.info("completed", **usage(done))
        answer = envelope(call, completion_id, int(time.time()), model,
                          [whole_choice(call.chat, i, a, logprobs) for i, a in enumerate(answers)], chunk=False)
        return web.json_response({**answer, "usage": usage(done)})

    async def _stream(self, request: web.Request, call: GenerateCall, completion_id: str, model: str, events,
                      bound, logprobs: bool) -> web.StreamResponse:
        """Server-sent events; the HTTP status is sent with the first event, so failures before it keep theirs."""
        created, response, done = int(time.time()), None, {}
        choices = [ChoiceStream(call.chat, j, logprobs) for j in range(call.n)]

        def chunk(choice: dict) -> dict:
            obj = envelope(call, completion_id, created, model, [choice], chunk=True)
            return {**obj, "usage": None} if call.include_usage else obj

        try:
            async for i, event in events:
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                    await response.prepare(request)
                    if call.chat:
                        for j in range(call.n):
                            await response.write(sse(chunk({"index": j, "delta": {"role": "assistant", "content": ""},
                                                            "logprobs": None, "finish_reason": None})))
                for choice in choices[i].choices(event):
                    await response.write(sse(chunk(choice)))
                if isinstance(event, Finished):
                    done[i] = event
            if call.include_usage and done:
                final = envelope(call, completion_id, created, model, [], chunk=True)
                await response.write(sse({**final, "usage": usage(list(done.values()))}))
        except PrimaError as exc:
            if response is None:
                raise
            bound.warning("stream failed", code=exc.code.name, message=exc.message)
            await response.write(sse(ApiError.from_grpc(exc).body()))
        await response.write(sse(b"[DONE]"))
        await response.write_eof()
        if done:
            bound.info("completed", **usage(list(done.values())))
        return response


def error_response(path: str, exc: ApiError) -> web.Response:
    """The error in its dialect's shape: Anthropic's under /v1/messages, Ollama's on its routes, else OpenAI's."""
    if path.startswith(anthropic_api.PATH):
        return web.json_response(anthropic_request.error_body(exc), status=exc.status)
    if ollama_api.is_ollama(path):
        return web.json_response(ollama_request.error_body(exc), status=exc.status)
    return exc.response()


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error in its dialect's shape (OpenAI's: {"error": {"message", "type", "param", "code"}})."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(request.path, exc)
    except web.HTTPException as exc:  # no such route, wrong method, body too large
        if exc.status < 400:
            raise
        response = error_response(request.path, ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}"))
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception as exc:  # a bug: still the dialect's shape and one line; the traceback goes to the log
        log.exception("internal error", path=request.path)
        return error_response(request.path,
                              ApiError(500, f"Internal error: {type(exc).__name__}: {' '.join(str(exc).split())}"))


def bearer_auth(token: str):
    expected, key = f"Bearer {token}".encode(), token.encode()

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        if web_page.is_public(request):  # the page and its files; the page asks for the token itself
            return await handler(request)
        # Anthropic's clients send the key as x-api-key
        if not (hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected)
                or hmac.compare_digest(request.headers.get("x-api-key", "").encode(), key)):
            raise ApiError(401, "Missing or incorrect API key: send 'Authorization: Bearer <the ring's token>' "
                                "(or x-api-key: <the ring's token>).",
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
    anthropic_api.setup(app, api)
    ollama_api.setup(app, api)
    web_page.setup(app, config.head, config.token)
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
