"""Anthropic Messages bodies onto GenerateRequest (JSON shapes here, ranges there), and Anthropic's error shape."""

import json
from dataclasses import dataclass, replace

from prima_rpc.app.openai_request import ApiError
from prima_rpc.request import GenerateRequest, Message, RequestError, Tool, ToolCall

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Fields whose effect the ring cannot give, and the values that ask for nothing.
UNSUPPORTED = {"thinking": (None,), "container": (None,), "mcp_servers": (None, [])}


def error_body(exc: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(param: str, expected: str, value) -> ApiError:
    return ApiError(400, f"{param}: expected {expected}, got {_show(value)}.", param, "invalid_value")


@dataclass(frozen=True)
class MessagesCall:
    """One validated /v1/messages request: what the head is asked, and how to answer."""

    request: GenerateRequest
    stream: bool
    model: str


def _text_blocks(value, param: str) -> str:
    """A string, or [{"type": "text", "text": ...}, ...] joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                       and isinstance(b.get("text"), str) for b in value):
        return "\n".join(b["text"] for b in value)
    raise _bad(param, "a string or text blocks", value)


def _user(blocks: list, where: str, names: dict[str, str]) -> list[Message]:
    """A user turn: its tool results (each its own tool message, first), then its text."""
    out, text = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_result" and isinstance(b.get("tool_use_id"), str):
            content = _text_blocks(b.get("content", ""), f"{where}.content.{j}.content")
            if b.get("is_error"):
                content = f"Error: {content}"
            out.append(Message("tool", content, (), b["tool_use_id"], names.get(b["tool_use_id"], "")))
        else:
            raise _bad(f"{where}.content.{j}", "a text or tool_result block (this server reads no images or "
                                               "documents)", b)
    return out + ([Message("user", "\n".join(text))] if text else [])


def _assistant(blocks: list, where: str) -> Message:
    text, calls = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict):
            calls.append(ToolCall(str(b.get("id") or f"toolu_{j}"), b["name"], json.dumps(b.get("input", {}))))
        else:
            raise _bad(f"{where}.content.{j}", "a text or tool_use block", b)
    return Message("assistant", "".join(text), tuple(calls))


def messages(body: dict) -> tuple[Message, ...]:
    """The system prompt and the turns, tool_use and tool_result blocks as the request's tool calls and results."""
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _bad("messages", "a non-empty array", turns)
    system = body.get("system")
    out = [Message("system", _text_blocks(system, "system"))] if system else []
    names: dict[str, str] = {}  # tool_use id -> name: a result's function, from its call
    for i, m in enumerate(turns):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role", "user or assistant", role)
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _bad(f"{where}.content", "a string or an array of content blocks", content)
        if role == "assistant":
            out.append(_assistant(blocks, where))
            names.update({c.id: c.name for c in out[-1].tool_calls})
        else:
            out += _user(blocks, where, names)
    return tuple(out)


def tools(body: dict) -> tuple[tuple[Tool, ...], str]:
    """(tools, tool_choice): [{"name", "description", "input_schema"}] and {"type": auto|any|tool|none, "name"}."""
    value = body.get("tools") or []
    if not isinstance(value, list):
        raise _bad("tools", "an array of tools", value)
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(
                t.get("input_schema", {}), dict):
            raise _bad(f"tools.{i}", '{"name": ..., "input_schema": {...}}', t)
        schema = t.get("input_schema")
        out.append(Tool(t["name"], str(t.get("description") or ""), json.dumps(schema) if schema else ""))
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None if choice is None else ""
    if kind not in (None, "auto", "any", "tool", "none") or (kind == "tool" and not isinstance(choice.get("name"),
                                                                                             str)):
        raise _bad("tool_choice", '{"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}', choice)
    word = {"any": "required", "tool": choice["name"] if kind == "tool" else ""}.get(kind, kind or "")
    return tuple(out), word


def _number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise _bad(name, "a number", value)
    return default if value is None else value


def _fields(body: dict) -> dict:
    """The sampling fields, type-checked (ranges: GenerateRequest's)."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _bad("max_tokens", "an integer (it is required)", max_tokens)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise _bad("top_k", "an integer", top_k)
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop_sequences", "an array of strings", stop)
    return {"max_tokens": max_tokens, "top_k": top_k or 0, "top_p": _number(body, "top_p", 1.0),
            "stop": tuple(stop)}


def parse_messages(body, default_temperature: float | None = None) -> MessagesCall:
    """Validate a decoded JSON body of /v1/messages; ApiError(400) says why not."""
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object, got {_show(body)}.")
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise ApiError(400, f"{name}: not supported by this server.", name, "unsupported_value")
    model, stream = body.get("model"), body.get("stream", False)
    if not isinstance(model, str):
        raise _bad("model", "a string (it is required)", model)
    if not isinstance(stream, bool):
        raise _bad("stream", "a boolean", stream)
    tool_list, choice = tools(body)
    try:
        request = GenerateRequest(messages=messages(body), temperature=_number(body, "temperature",
                                                                                default_temperature),
                                  tools=tool_list, tool_choice=choice, **_fields(body))
    except RequestError as exc:
        name = exc.field.partition("[")[0]
        param = {"stop": "stop_sequences"}.get(name, name)
        raise ApiError(400, f"{param}: {exc}.", param, "invalid_value") from None
    # top_p 0 keeps one token; on the wire 0 means off
    return MessagesCall(replace(request, temperature=0.0) if request.top_p == 0.0 else request, stream, model)
