"""Anthropic's Messages API (/v1/messages) on the same aiohttp app as OpenAI's: whole messages and streamed events,
tool use through the request's tool calls."""

import contextlib
import json
import uuid

from aiohttp import web

from prima_rpc.app.anthropic_request import STOP_REASONS, MessagesCall, error_body, parse_messages
from prima_rpc.app.dialect_io import call_input, json_body, whole_text
from prima_rpc.app.openai_request import ApiError
from prima_rpc.client import Finished, PrimaError, Token
from prima_rpc.request import ToolCall

PATH = "/v1/messages"


def content_blocks(text: str, calls: tuple[ToolCall, ...]) -> list[dict]:
    blocks = [{"type": "text", "text": text}] if text or not calls else []
    return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": call_input(c)} for c in calls]


def message(message_id: str, model: str, content: list[dict], done: Finished | None) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": STOP_REASONS.get(done.finish_reason, "end_turn") if done else None,
            "stop_sequence": None,
            "usage": {"input_tokens": done.prompt_tokens if done else 0,
                      "output_tokens": done.completion_tokens if done else 0}}


def event(kind: str, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


class Messages:
    """The /v1/messages handler on the OpenAI API's client of the head (`api`: its Api)."""

    def __init__(self, api):
        self.api = api

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        call = parse_messages(body, self.api.config.default_temperature)
        message_id = f"msg_{uuid.uuid4().hex}"
        model = await self.api.model_name()
        try:
            async with contextlib.aclosing(self.api.client.stream(call.request)) as events:
                if call.stream:
                    return await self._stream(request, call, message_id, model, events)
                text, done = await whole_text(events)
        except PrimaError as exc:
            raise ApiError.from_grpc(exc) from None
        return web.json_response(message(message_id, model, content_blocks(text, done.tool_calls), done))

    async def _stream(self, request: web.Request, call: MessagesCall, message_id: str, model: str,
                      events) -> web.StreamResponse:
        """message_start, the content blocks as they are generated, message_delta, message_stop. The HTTP status
        goes with the first event, so a failure before it keeps its own."""
        response, blocks = None, Blocks()
        try:
            async for e in events:
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                    await response.prepare(request)
                    await response.write(event("message_start", message=message(message_id, model, [], None)))
                for out in blocks.events(e):
                    await response.write(out)
        except PrimaError as exc:
            if response is None:
                raise
            await response.write(event("error", error=error_body(ApiError.from_grpc(exc))["error"]))
        await response.write_eof()
        return response


class Blocks:
    """A streamed message's content blocks: a text block while text comes, a tool_use block for each call from
    its name on (its arguments as input_json_delta pieces), the calls that were not streamed whole at the end."""

    def __init__(self):
        self.index, self.open, self.calls = -1, "", 0  # the current block's index and type; calls streamed

    def events(self, e: Token | Finished) -> list[bytes]:
        out = []
        if isinstance(e, Token):
            if e.text:
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": e.text}))
            for d in e.tool_calls:
                if d.name:
                    out += self._start({"type": "tool_use", "id": d.id, "name": d.name, "input": {}})
                    self.calls += 1
                elif d.arguments:
                    out.append(self._json(d.arguments))
            return out
        for c in e.tool_calls[self.calls:]:
            out += [*self._start({"type": "tool_use", "id": c.id, "name": c.name, "input": {}}),
                    self._json(c.arguments or "{}")]
        out += self._stop()
        final = message("", "", [], e)
        return out + [event("message_delta", delta={"stop_reason": final["stop_reason"], "stop_sequence": None},
                            usage=final["usage"]), event("message_stop")]

    def _start(self, block: dict) -> list[bytes]:
        out = self._stop()
        self.index, self.open = self.index + 1, block["type"]
        return out + [event("content_block_start", index=self.index, content_block=block)]

    def _stop(self) -> list[bytes]:
        was, self.open = self.open, ""
        return [event("content_block_stop", index=self.index)] if was else []

    def _json(self, piece: str) -> bytes:
        return event("content_block_delta", index=self.index, delta={"type": "input_json_delta", "partial_json": piece})


def setup(app: web.Application, api) -> None:
    app.router.add_post(PATH, Messages(api).create)
