"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show) on the same aiohttp app as OpenAI's: whole answers
and NDJSON streams."""

import contextlib
import json
from datetime import UTC, datetime

import grpc
from aiohttp import web

from prima_rpc.app.dialect_io import call_input, json_body, whole_text
from prima_rpc.app.ollama_request import OllamaCall, error_body, parse_ollama
from prima_rpc.app.openai_request import ApiError
from prima_rpc.client import Finished, PrimaError, Token

PREFIX = "/api/"  # shared with the web page's own /api/ring and /api/plan
ROUTES = ("chat", "generate", "tags", "show")


def is_ollama(path: str) -> bool:
    """Whether `path` is one of Ollama's routes (whose errors take Ollama's shape)."""
    return path.startswith(PREFIX) and path[len(PREFIX):] in ROUTES
DONE_REASONS = {"tool_calls": "stop"}  # Ollama ends a call's turn with "stop"


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _calls(done: Finished) -> list[dict]:
    return [{"function": {"name": c.name, "arguments": call_input(c)}} for c in done.tool_calls]


def part(model: str, chat: bool, text: str, done: Finished | None = None, reason: str = "") -> dict:
    """One line of an answer: its text, and on the last the end and its counts (durations in ns, as Ollama's)."""
    if chat:
        message = {"role": "assistant", "content": text}
        if done is not None and done.tool_calls:
            message["tool_calls"] = _calls(done)
        out = {"model": model, "created_at": now(), "message": message, "done": done is not None or bool(reason)}
    else:
        out = {"model": model, "created_at": now(), "response": text, "done": done is not None or bool(reason)}
    if reason:
        out["done_reason"] = reason
    if done is not None:
        prompt_ns, eval_ns = int(done.ttft_ms * 1e6), int(done.tpot_ms * 1e6 * max(done.completion_tokens - 1, 0))
        out |= {"done_reason": DONE_REASONS.get(done.finish_reason, done.finish_reason),
                "total_duration": prompt_ns + eval_ns, "load_duration": 0, "prompt_eval_count": done.prompt_tokens,
                "prompt_eval_duration": prompt_ns, "eval_count": done.completion_tokens, "eval_duration": eval_ns}
    return out


class Ollama:
    """The /api/ handlers on the OpenAI API's client of the head (`api`: its Api)."""

    def __init__(self, api):
        self.api = api

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await json_body(request)
        config = self.api.config
        call = parse_ollama(body, chat, config.default_max_tokens, config.default_temperature)
        model = await self.api.model_name()
        if call.request is None:  # an empty request loads the model: it is loaded
            return web.json_response(part(model, chat, "", reason="load"))
        try:
            async with contextlib.aclosing(self.api.client.stream(call.request)) as events:
                if call.stream:
                    return await self._stream(request, call, model, chat, events)
                text, done = await whole_text(events)
        except PrimaError as exc:
            raise ApiError.from_grpc(exc) from None
        return web.json_response(part(model, chat, text, done))

    async def _stream(self, request: web.Request, call: OllamaCall, model: str, chat: bool,
                      events) -> web.StreamResponse:
        """NDJSON: a line per token, the last with done true; the status goes with the first line."""
        response = None
        try:
            async for e in events:
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
                    await response.prepare(request)
                line = part(model, chat, e.text) if isinstance(e, Token) else part(model, chat, "", e)
                if isinstance(e, Finished) or e.text:
                    await response.write(json.dumps(line).encode() + b"\n")
        except PrimaError as exc:
            if response is None:
                raise
            await response.write(json.dumps(error_body(ApiError.from_grpc(exc))).encode() + b"\n")
        await response.write_eof()
        return response

    async def _model(self) -> dict:
        """The ring's model as /api/tags lists it."""
        name = await self.api.model_name()
        try:
            info = await self.api.head.info()
        except grpc.aio.AioRpcError as exc:
            raise ApiError.from_grpc(PrimaError(exc.code(), exc.details()), self.api.config.head) from None
        modified = datetime.fromtimestamp(self.api.created, UTC).isoformat().replace("+00:00", "Z")
        return {"name": name, "model": name, "modified_at": modified, "size": 0,
                "digest": info.model_id, "details": {"format": "prima", "family": "", "families": [],
                                                     "parameter_size": "", "quantization_level": ""},
                "n_layers": info.n_layers}

    async def tags(self, request: web.Request) -> web.Response:
        card = await self._model()
        card.pop("n_layers")
        return web.json_response({"models": [card]})

    async def show(self, request: web.Request) -> web.Response:
        """Any name is the ring's model, as for chat (clients ask for "llama3", "qwen", ...)."""
        body = await json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("model") or body.get("name"), str):
            raise ApiError(400, "invalid model: expected {\"model\": NAME}", "model")
        card = await self._model()
        return web.json_response({
            "modelfile": "", "parameters": "", "template": "", "details": card["details"],
            "model_info": {"general.name": card["name"], "general.block_count": card["n_layers"]},
            "capabilities": ["completion", "tools"], "modified_at": card["modified_at"]})


def setup(app: web.Application, api) -> None:
    ollama = Ollama(api)
    app.router.add_post(PREFIX + "chat", ollama.chat)
    app.router.add_post(PREFIX + "generate", ollama.generate)
    app.router.add_get(PREFIX + "tags", ollama.tags)
    app.router.add_post(PREFIX + "show", ollama.show)
