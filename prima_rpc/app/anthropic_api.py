"""Anthropic's Messages API (/v1/messages) on the same aiohttp app as OpenAI's: whole messages and streamed events,
tool use through the request's tool calls."""

import contextlib
import json
import uuid

from aiohttp import web

from prima_rpc.app.anthropic_request import STOP_REASONS, MessagesCall, error_body, parse_messages
from prima_rpc.app.dialect_io import json_body, whole_text
from prima_rpc.app.openai_request import ApiError
from prima_rpc.client import Finished, PrimaError, Token
from prima_rpc.request import ToolCall

PATH = "/v1/messages"


def content_blocks(text: str, calls: tuple[ToolCall, ...]) -> list[dict]:
    blocks = [{"type": "text", "text": text}] if text or not calls else []
    return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments or "{}")}
                     for c in calls]


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
        """message_start, a text block's deltas, tool_use blocks, message_delta, message_stop. The HTTP status goes
        with the first event, so a failure before it keeps its own."""
        response, block = None, -1  # the index of the open text block (-1: none yet)
        try:
            async for e in events:
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                    await response.prepare(request)
                    await response.write(event("message_start", message=message(message_id, model, [], None)))
                if isinstance(e, Token):
                    if e.text and block < 0:
                        block = 0
                        await response.write(event("content_block_start", index=0,
                                                   content_block={"type": "text", "text": ""}))
                    if e.text:
                        await response.write(event("content_block_delta", index=0,
                                                   delta={"type": "text_delta", "text": e.text}))
                    continue
                await self._end(response, e, block)
        except PrimaError as exc:
            if response is None:
                raise
            await response.write(event("error", error=error_body(ApiError.from_grpc(exc))["error"]))
        await response.write_eof()
        return response

    async def _end(self, response: web.StreamResponse, done: Finished, block: int) -> None:
        if block >= 0:
            await response.write(event("content_block_stop", index=block))
        for i, c in enumerate(done.tool_calls, start=block + 1):
            await response.write(event("content_block_start", index=i,
                                       content_block={"type": "tool_use", "id": c.id, "name": c.name, "input": {}}))
            await response.write(event("content_block_delta", index=i,
                                       delta={"type": "input_json_delta", "partial_json": c.arguments or "{}"}))
            await response.write(event("content_block_stop", index=i))
        final = message("", "", [], done)
        await response.write(event("message_delta", delta={"stop_reason": final["stop_reason"], "stop_sequence": None},
                                   usage=final["usage"]))
        await response.write(event("message_stop"))


def setup(app: web.Application, api) -> None:
    app.router.add_post(PATH, Messages(api).create)
