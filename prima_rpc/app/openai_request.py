"""OpenAI request bodies onto GenerateRequest (a thin adapter: JSON types and names here, ranges there), with
OpenAI's error shape."""

import json
from dataclasses import dataclass, replace

import grpc
from aiohttp import web

from prima_rpc.app import openai_tools
from prima_rpc.app.rpc_message import rpc_message
from prima_rpc.client import PrimaError
from prima_rpc.request import (
    DEPTH,
    DRAFT_TOKENS,
    MAX_STOP,
    MAX_TOKENS,
    PENALTY,
    REPETITION_PENALTY,
    SPECULATE,
    TEMPERATURE,
    TOP_K,
    TOP_LOGPROBS,
    TOP_P,
    GenerateRequest,
    Message,
    RequestError,
)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 503,  # the node is not (yet) a head: the ring is not started
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}  # any other status: 500

MAX_BODY_BYTES = 8 << 20  # the head takes prompts up to 1 Mi characters
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_N = 8  # choices per request: each is its own request on the ring
# Fields whose effect the ring cannot give, and the values that ask for nothing.
UNSUPPORTED = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "functions": (None, []),
    "logit_bias": (None, {}),
}


class ApiError(Exception):
    """A request the API answers with `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_grpc(cls, exc: PrimaError, address: str = "") -> "ApiError":
        """The head's status as HTTP, with the message prima-ctl would print (address: the node called, when
        the message does not name it)."""
        return cls(HTTP_STATUS.get(exc.code, 500), rpc_message(exc.code, exc.message, address),
                   code=exc.code.name.lower())

    def body(self) -> dict:
        kind = ("server_error" if self.status >= 500 else "rate_limit_error" if self.status == 429
                else "authentication_error" if self.status == 401 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


# ---------------------------------------------------------------- requests: JSON body -> GenerateCall


@dataclass(frozen=True)
class GenerateCall:
    """One validated completion request: what the head is asked, and how to answer."""

    chat: bool  # /v1/chat/completions (messages, chat template) or /v1/completions (raw prompt)
    request: GenerateRequest
    stream: bool
    include_usage: bool
    model: str | None
    n: int = 1  # choices: n requests on the ring (seeded seed, seed + 1, ... when a seed is given)


# What each GenerateRequest field takes, in OpenAI's words (its ranges: the wire's; negative seeds wrap).
SEED = (-(2**63), 2**64 - 1)
EXPECTED = {
    "max_tokens": f"an integer in [{MAX_TOKENS[0]}, {MAX_TOKENS[1]}]",
    "temperature": f"a number in [{TEMPERATURE[0]:g}, {TEMPERATURE[1]:g}]",
    "top_p": f"a number in [{TOP_P[0]:g}, {TOP_P[1]:g}]",
    "top_k": f"an integer in [{TOP_K[0]}, {TOP_K[1]}]",
    "seed": f"an integer in [{SEED[0]}, {SEED[1]}]",
    "stop": f"a non-empty string or up to {MAX_STOP} of them",
    "speculate": f"one of {', '.join(SPECULATE)}",
    "draft_tokens": f"an integer in [{DRAFT_TOKENS[0]}, {DRAFT_TOKENS[1]}]",
    "depth": f"an integer in [{DEPTH[0]}, {DEPTH[1]}]",
    "presence_penalty": f"a number in [{PENALTY[0]:g}, {PENALTY[1]:g}]",
    "frequency_penalty": f"a number in [{PENALTY[0]:g}, {PENALTY[1]:g}]",
    "repetition_penalty": f"a number in ({REPETITION_PENALTY[0]:g}, {REPETITION_PENALTY[1]:g}]",
    "top_logprobs": f"an integer in [{TOP_LOGPROBS[0]}, {TOP_LOGPROBS[1]}]",
    "logprobs": f"an integer in [{TOP_LOGPROBS[0]}, {TOP_LOGPROBS[1]}] (completions) or a boolean (chat)",
    "n": f"an integer in [1, {MAX_N}]",
}


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _invalid(param: str, field: str, value) -> ApiError:
    return ApiError(400, f"Invalid '{param}': expected {EXPECTED[field]}, got {_show(value)}.", param, "invalid_value")


def _integer(body: dict, name: str, field: str | None = None) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _invalid(name, field or name, value)
    return value


def _number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(name, name, value)
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


def _messages(body: dict) -> tuple[Message, ...]:
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
        calls = m.get("role") == "assistant" and m.get("tool_calls")
        content = "" if calls and m.get("content") is None else _text(m.get("content"), f"{where}.content")
        try:
            out.append(openai_tools.message(m, ROLES[m["role"]], content, where))
        except openai_tools.BodyError as exc:
            raise ApiError(400, str(exc), exc.param, "invalid_value") from None
    names = {c.id: c.name for m in out for c in m.tool_calls}  # a tool result's function, from its call
    return tuple(m._replace(name=m.name or names.get(m.tool_call_id, "")) if m.role == "tool" else m for m in out)


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
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _invalid("stop", "stop", body.get("stop"))
    return tuple(stop)


def _answer_shape(body) -> tuple[str | None, bool, bool]:
    """(model, stream, include_usage): the fields that say how to answer, not what to generate."""
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
    return model, stream, bool(options and options.get("include_usage"))


def _generate_request(body: dict, chat: bool, default_max_tokens: int,
                      default_temperature: float | None) -> GenerateRequest:
    """The body's generate fields, type-checked here and range-checked by GenerateRequest (ApiError naming the
    body's parameter)."""
    max_tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, max_tokens_name, "max_tokens")
    seed = _integer(body, "seed")
    if seed is not None and not SEED[0] <= seed <= SEED[1]:
        raise _invalid("seed", "seed", seed)
    draft_tokens = _integer(body, "draft_tokens")
    if draft_tokens == 0:  # on the wire 0 asks for the default; in a body it is out of range
        raise _invalid("draft_tokens", "draft_tokens", 0)
    depth = _integer(body, "depth")
    if depth == 0:
        raise _invalid("depth", "depth", 0)
    prompt, messages = ("", _messages(body)) if chat else (_prompt(body), ())
    logprobs, top_logprobs = _logprobs(body, chat)
    template_kwargs = _template_kwargs(body, chat)
    try:
        tools = openai_tools.tools(body) if chat else ()
        choice = openai_tools.tool_choice(body) if chat else ""
        response_format, schema = openai_tools.response_format(body)
    except openai_tools.BodyError as exc:
        raise ApiError(400, str(exc), exc.param, "invalid_value") from None
    try:
        request = GenerateRequest(
            prompt=prompt, messages=messages, raw=not chat,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=_number(body, "temperature", default_temperature),  # OpenAI's is 1; ours: the model's
            top_p=_number(body, "top_p", 1.0), top_k=_integer(body, "top_k") or 0,
            seed=None if seed is None else seed % 2**64, stop=_stop(body),
            speculate=body.get("speculate") or "", draft_tokens=draft_tokens or 0,
            depth=depth or 0,
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0), logprobs=logprobs,
            top_logprobs=top_logprobs, response_format=response_format, json_schema=schema, tools=tools,
            tool_choice=choice, chat_template_kwargs=template_kwargs)
    except RequestError as exc:
        field = exc.field.partition("[")[0]
        if exc.field in EXPECTED:  # out of range
            param = max_tokens_name if field == "max_tokens" else field
            raise _invalid(param, field, body.get(param)) from None
        # JSON may carry lone surrogates (a message's content); a tool is named with its index
        param = f"{exc.field}.content" if field == "messages" and "UTF-8" in str(exc) else \
            exc.field if field in ("tools", "messages") else {"json_schema": "response_format"}.get(field, field)
        raise ApiError(400, f"Invalid '{param}': {exc}.", param, "invalid_value") from None
    # top_p 0 keeps one token; on the wire 0 means off
    return replace(request, temperature=0.0) if request.top_p == 0.0 else request


def _template_kwargs(body: dict, chat: bool) -> str:
    """chat_template_kwargs (vLLM's and llama.cpp server's name: {"enable_thinking": false} for Qwen3) as JSON
    text; chat completions only, the completions endpoint has no template."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return ""
    if not chat or not isinstance(value, dict):
        raise ApiError(400, f"Invalid 'chat_template_kwargs': expected an object (chat completions only), got "
                       f"{_show(value)}.", "chat_template_kwargs", "invalid_value")
    return json.dumps(value) if value else ""


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """(logprobs, top_logprobs): chat's boolean and count, or completions' one count."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise _invalid("logprobs", "logprobs", value)
        top = _integer(body, "top_logprobs") or 0
        if top and not value:
            raise ApiError(400, "Invalid 'top_logprobs': it needs logprobs true.", "top_logprobs", "invalid_value")
        return bool(value), top
    top = _integer(body, "logprobs", "logprobs")
    return top is not None, top or 0


def _n(body: dict) -> int:
    n = _integer(body, "n", "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise _invalid("n", "n", n)
    return n or 1


def parse_request(body, chat: bool, default_max_tokens: int, default_temperature: float | None = None
                  ) -> GenerateCall:
    """Validate a decoded JSON body of /v1/chat/completions (chat) or /v1/completions; ApiError(400) says why not."""
    model, stream, include_usage = _answer_shape(body)
    return GenerateCall(chat=chat, request=_generate_request(body, chat, default_max_tokens, default_temperature),
                        stream=stream, include_usage=include_usage, model=model, n=_n(body))


# ---------------------------------------------------------------- answers: events -> OpenAI objects
