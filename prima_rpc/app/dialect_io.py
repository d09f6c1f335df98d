"""What every HTTP dialect (OpenAI, Anthropic, Ollama) does alike: read the JSON body, collect a whole answer, read a
call's arguments."""

import json
from collections.abc import AsyncIterator

from aiohttp import web

from prima_rpc.app.openai_request import ApiError
from prima_rpc.client import Finished, Token
from prima_rpc.request import ToolCall


async def json_body(request: web.Request):
    """The request's body as JSON; ApiError(400) when it does not parse (each dialect words it in its own shape)."""
    try:
        return json.loads(await request.read())
    except ValueError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}.") from None


async def whole_text(events: AsyncIterator[Token | Finished]) -> tuple[str, Finished]:
    """A stream run to its end: the text of its tokens and its Finished."""
    text, done = [], None
    async for e in events:
        if isinstance(e, Token):
            text.append(e.text)
        else:
            done = e
    return "".join(text), done


def call_input(call: ToolCall) -> dict:
    """A call's arguments as an object; {} for those cut short by max_tokens (the dialects that want an object)."""
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
