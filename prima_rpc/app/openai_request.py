"""OpenAI request bodies into the head's generate arguments: validated, with OpenAI's error shape."""

import json
import math
from dataclasses import dataclass

import grpc
from aiohttp import web

from prima_rpc.app.rpc_message import rpc_message
from prima_rpc.client import (
    DRAFT_TOKENS,
    MAX_STOP,
    MAX_TOKENS,
    SPECULATE,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    PrimaError,
    check_text,
)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 503,  # the node is not (yet) a head: the ring is not started
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}  # any other status: 500

MAX_BODY_BYTES = 8 << 20  # the head takes prompts up to 1 Mi characters
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields whose effect the ring cannot give, and the values that ask for nothing.
UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "logit_bias": (None, {}), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "response_format": (None, {"type": "text"}),
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
    """One validated completion request: the arguments of PrimaClient.generate and how to answer."""

    chat: bool  # /v1/chat/completions (messages, chat template) or /v1/completions (raw prompt)
    prompt: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None
    speculate: str = ""  # this server's extension: "off" | "ngram" | "draft" ("": the head's default)
    draft_tokens: int = 0

    def generate_kwargs(self) -> dict:
        return dict(prompt=self.prompt, messages=[{"role": r, "content": c} for r, c in self.messages] or None,
                    raw=not self.chat, max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=self.stop, speculate=self.speculate,
                    draft_tokens=self.draft_tokens)


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(400, f"Invalid '{name}': expected an integer in [{lo}, {hi}], got {_show(value)}.", name,
                       "invalid_value")
    return value


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or not lo <= value <= hi):
        raise ApiError(400, f"Invalid '{name}': expected a number in [{lo:g}, {hi:g}], got {_show(value)}.", name,
                       "invalid_value")
    return float(value)


def _utf8(value: str, param: str) -> str:
    """JSON may carry lone surrogates ("\\udce9"), which are not text the head can take."""
    try:
        return check_text(value, "the text")
    except ValueError as exc:
        raise ApiError(400, f"Invalid '{param}': {exc}.", param, "invalid_value") from None


def _text(value, param: str) -> str:
    """A string, or OpenAI's content parts [{"type": "text", "text": ...}] joined by newlines."""
    if isinstance(value, str):
        return _utf8(value, param)
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return _utf8("\n".join(p["text"] for p in value), param)
    raise ApiError(400, f"Invalid '{param}': expected a string or text content parts, got {_show(value)}.", param,
                   "invalid_type")


def _messages(body: dict) -> tuple[tuple[str, str], ...]:
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
        out.append((ROLES[m["role"]], _text(m.get("content"), f"{where}.content")))
    return tuple(out)


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, f"Invalid 'prompt': expected one non-empty string, got {_show(prompt)}.", "prompt",
                       "invalid_value")
    return _utf8(prompt, "prompt")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, f"Invalid 'stop': expected a non-empty string or up to {MAX_STOP} of them, got "
                       f"{_show(body.get('stop'))}.", "stop", "invalid_value")
    return tuple(_utf8(s, "stop") for s in stop)


def parse_request(body, chat: bool, default_max_tokens: int) -> GenerateCall:
    """Validate a decoded JSON body of /v1/chat/completions (chat) or /v1/completions; ApiError(400) says why not."""
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
    max_tokens = _integer(body, "max_completion_tokens", *MAX_TOKENS) or _integer(body, "max_tokens", *MAX_TOKENS)
    temperature = _number(body, "temperature", *TEMPERATURE, 1.0)  # OpenAI's default is 1: sampling
    top_p = _number(body, "top_p", *TOP_P, 1.0)
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)
    speculate = body.get("speculate") or ""
    if speculate not in ("", *SPECULATE):
        raise ApiError(400, f"Invalid 'speculate': expected one of {', '.join(SPECULATE)}, got {_show(speculate)}.",
                       "speculate", "invalid_value")
    return GenerateCall(
        speculate=speculate, draft_tokens=_integer(body, "draft_tokens", *DRAFT_TOKENS) or 0,
        chat=chat, prompt="" if chat else _prompt(body), messages=_messages(body) if chat else (),
        max_tokens=max_tokens or default_max_tokens,
        temperature=0.0 if top_p == 0.0 else temperature,  # top_p 0 keeps one token; on the wire 0 means off
        top_p=top_p, top_k=_integer(body, "top_k", *TOP_K) or 0,
        seed=None if seed is None else seed % 2**64, stop=_stop(body), stream=stream,
        include_usage=bool(options and options.get("include_usage")), model=model)


# ---------------------------------------------------------------- answers: events -> OpenAI objects
