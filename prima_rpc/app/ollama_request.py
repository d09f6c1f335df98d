"""Ollama's /api/chat and /api/generate bodies onto GenerateRequest (JSON shapes and option names here, ranges
there)."""

import json
from dataclasses import dataclass, replace

from prima_rpc.app import openai_tools
from prima_rpc.app.openai_request import ApiError
from prima_rpc.request import GenerateRequest, Message, RequestError, ToolCall

ROLES = ("system", "user", "assistant", "tool")
# options: Ollama's name -> GenerateRequest's; the others (num_ctx, num_gpu, mirostat, ...) are the runner's
# business there and are ignored here, as Ollama ignores options a model does not use.
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
           "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
INTEGERS = ("top_k", "seed", "num_predict")


def error_body(exc: ApiError) -> dict:
    return {"error": exc.message}


def _bad(param: str, expected: str, value) -> ApiError:
    text = json.dumps(value)
    return ApiError(400, f"invalid {param}: expected {expected}, got {text if len(text) <= 40 else text[:37] + '...'}",
                    param, "invalid_value")


@dataclass(frozen=True)
class OllamaCall:
    """One validated /api/chat or /api/generate request; `request` None: an empty one, which only loads the model."""

    request: GenerateRequest | None
    stream: bool
    model: str


def _options(body: dict, default_max_tokens: int, default_temperature: float | None) -> dict:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise _bad("options", "an object", options)
    fields = {"max_tokens": default_max_tokens, "temperature": default_temperature}
    for name, field in OPTIONS.items():
        value = options.get(name)
        if value is None:
            continue
        if name == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise _bad("options.stop", "a string or an array of strings", value)
            value = tuple(value)
        elif isinstance(value, bool) or not isinstance(value, int if name in INTEGERS else int | float):
            raise _bad(f"options.{name}", "an integer" if name in INTEGERS else "a number", value)
        if name == "num_predict" and value < 0:  # -1: until the end, -2: fill the context; both: serve's default
            value = default_max_tokens
        if name == "seed":
            value %= 2**64
        fields[field] = value
    return fields


def _format(body: dict) -> dict:
    """format: "json" or a JSON Schema object."""
    value = body.get("format")
    if value in (None, ""):
        return {}
    if value == "json":
        return {"response_format": "json_object"}
    if isinstance(value, dict):
        return {"response_format": "json_schema", "json_schema": json.dumps(value)}
    raise _bad("format", '"json" or a JSON Schema object', value)


def _tool_calls(m: dict, i: int) -> tuple[ToolCall, ...]:
    calls = m.get("tool_calls") or []
    out = []
    for j, c in enumerate(calls if isinstance(calls, list) else [None]):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(
                f.get("arguments", {}), dict):
            raise _bad(f"messages[{i}].tool_calls", '[{"function": {"name": ..., "arguments": {...}}}]', calls)
        out.append(ToolCall(f"call_{i}_{j}", f["name"], json.dumps(f.get("arguments", {}))))
    return tuple(out)


def messages(body: dict) -> tuple[Message, ...]:
    """The chat; a tool message answers its assistant's calls in order (Ollama's calls carry no ids)."""
    value = body.get("messages") or []
    if not isinstance(value, list):
        raise _bad("messages", "an array", value)
    out, pending = [], []  # the last assistant's calls not answered yet
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}].role", " or ".join(ROLES), m.get("role") if isinstance(m, dict) else m)
        if not isinstance(m.get("content", ""), str):
            raise _bad(f"messages[{i}].content", "a string", m.get("content"))
        if m.get("images"):
            raise ApiError(400, f"messages[{i}].images: this server reads no images", "images", "unsupported_value")
        content = m.get("content") or ""
        if m["role"] == "tool":
            call = pending.pop(0) if pending else None
            name = str(m.get("tool_name") or m.get("name") or (call.name if call else ""))
            out.append(Message("tool", content, (), call.id if call else "", name))
            continue
        calls = _tool_calls(m, i) if m["role"] == "assistant" else ()
        pending = list(calls) if calls else pending
        out.append(Message(m["role"], content, calls))
    return tuple(out)


def _generate(body: dict) -> tuple[dict, bool]:
    """/api/generate's prompt, system and raw as request fields; (fields, empty: only loads the model)."""
    for name in ("suffix", "images", "template", "context"):
        if body.get(name):
            raise ApiError(400, f"{name}: not supported by this server", name, "unsupported_value")
    prompt, system, raw = body.get("prompt") or "", body.get("system") or "", body.get("raw", False)
    if not isinstance(prompt, str) or not isinstance(system, str) or not isinstance(raw, bool):
        raise _bad("prompt", "prompt and system strings and raw a boolean", [prompt, system, raw])
    if raw:
        return {"prompt": prompt, "raw": True}, not prompt
    turns = ([Message("system", system)] if system else []) + [Message("user", prompt)]
    return {"messages": tuple(turns)}, not prompt


def parse_ollama(body, chat: bool, default_max_tokens: int, default_temperature: float | None = None
                 ) -> OllamaCall:
    """Validate a decoded JSON body of /api/chat (chat) or /api/generate; ApiError(400) says why not."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model, stream = body.get("model"), body.get("stream", True)  # Ollama streams unless told not to
    if not isinstance(model, str) or not model:
        raise _bad("model", "a model name (it is required)", model)
    if not isinstance(stream, bool):
        raise _bad("stream", "a boolean", stream)
    if chat:
        turns = messages(body)
        fields, empty = {"messages": turns}, not turns
        try:
            fields |= {"tools": openai_tools.tools(body)}
        except openai_tools.BodyError as exc:
            raise ApiError(400, str(exc), exc.param, "invalid_value") from None
    else:
        fields, empty = _generate(body)
    if empty:
        return OllamaCall(None, stream, model)
    think = body.get("think")
    if think is not None and not isinstance(think, bool):
        raise _bad("think", "a boolean", think)
    if think is not None and not fields.get("raw"):  # Ollama's switch is the template's enable_thinking (Qwen3)
        fields["chat_template_kwargs"] = json.dumps({"enable_thinking": think})
    try:
        request = GenerateRequest(**fields, **_format(body), **_options(body, default_max_tokens, default_temperature))
    except RequestError as exc:
        raise ApiError(400, f"invalid {exc.field}: {exc}", exc.field, "invalid_value") from None
    # top_p 0 keeps one token; on the wire 0 means off
    return OllamaCall(replace(request, temperature=0.0) if request.top_p == 0.0 else request, stream, model)
