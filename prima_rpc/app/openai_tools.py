"""OpenAI's tools, tool_choice, response_format and tool messages onto the request's words (JSON types here; names
and schemas checked by GenerateRequest)."""

import json

from prima_rpc.request import Message, Tool, ToolCall


class BodyError(ValueError):
    """A part of the body of the wrong shape: `param` names it as OpenAI does."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def tools(body: dict) -> tuple[Tool, ...]:
    """[{"type": "function", "function": {"name", "description", "parameters"}}, ...]."""
    value = body.get("tools") or []
    if not isinstance(value, list):
        raise BodyError("tools", f"Invalid 'tools': expected an array of functions, got {_show(value)}.")
    out = []
    for i, t in enumerate(value):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("parameters", {}),
                                                                                            dict):
            raise BodyError(f"tools[{i}]", f"Invalid 'tools[{i}]': expected {{\"type\": \"function\", \"function\": "
                                           f"{{\"name\": ..., \"parameters\": {{...}}}}}}, got {_show(t)}.")
        params = f.get("parameters")
        out.append(Tool(f["name"], str(f.get("description") or ""), json.dumps(params) if params else ""))
    return tuple(out)


def tool_choice(body: dict) -> str:
    """"auto" | "none" | "required" | {"type": "function", "function": {"name": ...}} -> the request's word."""
    value = body.get("tool_choice")
    if value is None or value in ("auto", "none", "required"):
        return value or ""
    name = value.get("function", {}).get("name") if isinstance(value, dict) else None
    if not isinstance(name, str) or not name:
        raise BodyError("tool_choice", "Invalid 'tool_choice': expected auto, none, required or "
                                       f'{{"type": "function", "function": {{"name": ...}}}}, got {_show(value)}.')
    return name


def response_format(body: dict) -> tuple[str, str]:
    """(format, schema JSON text) of {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema"}}."""
    value = body.get("response_format")
    if value is None:
        return "", ""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object"):
        return kind, ""
    schema = value.get("json_schema", {}).get("schema") if kind == "json_schema" and isinstance(
        value.get("json_schema"), dict) else None
    if not isinstance(schema, dict):
        raise BodyError("response_format", """Invalid 'response_format': expected {"type": "text"}, """
                                           """{"type": "json_object"} or {"type": "json_schema", "json_schema": """
                                           f'{{"name": ..., "schema": {{...}}}}}}, got {_show(value)}.')
    return "json_schema", json.dumps(schema)


def tool_calls(m: dict, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's [{"id", "type": "function", "function": {"name", "arguments": JSON text}}]."""
    value = m.get("tool_calls") or []
    out = []
    for i, c in enumerate(value if isinstance(value, list) else [None]):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(
                f.get("arguments", "{}"), str):
            raise BodyError(f"{where}.tool_calls", f"Invalid '{where}.tool_calls[{i}]': expected {{\"id\", \"type\": "
                                                   f"\"function\", \"function\": {{\"name\", \"arguments\"}}}}.")
        out.append(ToolCall(str(c.get("id") or f"call_{i}"), f["name"], f.get("arguments") or "{}"))
    return tuple(out)


def message(m: dict, role: str, content: str, where: str) -> Message:
    """A chat message with what tools add: an assistant's calls, a tool result's call id."""
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise BodyError(f"{where}.tool_call_id", f"Invalid '{where}': a tool message needs its tool_call_id.")
        return Message("tool", content, (), call_id, str(m.get("name") or ""))
    return Message(role, content, tool_calls(m, where) if role == "assistant" else ())
