"""What every HTTP dialect (OpenAI, Anthropic, Ollama) does alike: read the JSON body, collect a whole answer, read a
call's arguments."""

import json
from collections.abc import AsyncIterator

from aiohttp import web

from prima_rpc.app.openai_request import ApiError
from prima_rpc.client import Finished, Token
from prima_rpc.request import ToolCall

MAX_DEPTH = 64  # nesting of arrays and objects: a schema or a message needs a handful; the parser's stack ends ~1000


async def json_body(request: web.Request):
    """The request's body as JSON; ApiError(400) when it does not parse or nests deeper than MAX_DEPTH (the code
    that walks a body, a schema's grammar among it, recurses), each dialect wording it in its own shape."""
    try:
        body = json.loads(await request.read())
        deep = _deeper(body, MAX_DEPTH)
    except RecursionError:
        deep = True
    except ValueError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}.") from None
    if deep:
        raise ApiError(400, f"The JSON body of your request nests arrays and objects more than {MAX_DEPTH} deep.")
    return body


def _deeper(value, limit: int) -> bool:
    """Whether `value` nests lists and dicts more than `limit` levels deep (walked without recursion)."""
    level = [value]
    for _ in range(limit + 1):
        level = [v for x in level if isinstance(x, (list, dict)) for v in (x.values() if isinstance(x, dict) else x)]
        if not level:
            return False
    return True


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
