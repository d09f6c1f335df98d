"""The chaos soak's load: a mix of requests through the HTTP API (streamed and whole chat, a tool call, a
json_schema answer, a long prompt, n = 2, one Anthropic and one Ollama request), each answer reduced to what
greedy decoding fixes (its text, tool calls, finish reasons) so that it can be compared with the single-process
reference; and what a request came to: completed, refused (a clear retriable error), or lost."""

import json
import time
from dataclasses import dataclass, field

from tools.bench.http_harness import post, post_stream

# ~300 tokens of the tiny synthetic model's byte-level vocabulary: two prefill chunks (256 each) within its 512
LONG = "A note. " + " ".join(f"Item {i} is {i}." for i in range(24))
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"]}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
MIX = {  # name -> (path, body, streamed); greedy, to be checked against the reference
    "chat-stream": ("/v1/chat/completions", {"model": "m", "messages": ASK, "max_tokens": 16, "stream": True,
                                             "temperature": 0}, True),
    "chat": ("/v1/chat/completions", {"model": "m", "messages": ASK, "max_tokens": 16, "temperature": 0}, False),
    "tool-call": ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "Weather in Paris?"}], "tools": [TOOL],
        "tool_choice": "required", "max_tokens": 24, "temperature": 0}, False),
    "json-schema": ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "Describe Paris's weather as JSON."}], "max_tokens": 24,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}}, False),
    "long-prompt": ("/v1/completions", {"model": "m", "prompt": LONG, "max_tokens": 12, "temperature": 0}, False),
    "n2": ("/v1/completions", {"model": "m", "prompt": "The three primary colors are", "max_tokens": 10, "n": 2,
                               "temperature": 0}, False),
    "anthropic": ("/v1/messages", {"model": "m", "messages": ASK, "max_tokens": 16, "temperature": 0}, False),
    "ollama": ("/api/chat", {"model": "m", "messages": ASK, "stream": False,
                             "options": {"num_predict": 16, "temperature": 0}}, False),
}
VOLATILE = {"id", "created", "created_at", "system_fingerprint", "total_duration", "load_duration",
            "prompt_eval_duration", "eval_duration", "model", "drafted", "accepted"}  # speculation: timing-dependent
RETRIABLE_HTTP = {503, 504, 529}  # the dialects' words for UNAVAILABLE / DEADLINE_EXCEEDED / overloaded


@dataclass
class Outcome:
    """One try of a request: "ok" with its answer, "refused" (a clear retriable error), or "lost" (why)."""

    kind: str
    answer: str = ""
    why: str = ""
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)


def _strip(value):
    """A response without what varies between equal answers (ids, clocks)."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _error_of(value) -> str:
    """The message of a dialect's error object, if `value` is one."""
    if isinstance(value, dict) and "error" in value:
        err = value["error"]
        return (err.get("message") if isinstance(err, dict) else str(err)) or "an error without a message"
    if isinstance(value, dict) and value.get("type") == "error":
        return str(value.get("error", {}).get("message", "")) or "an error without a message"
    return ""


def _whole(status: int, text: bytes) -> Outcome:
    try:
        value = json.loads(text)
    except ValueError:
        return Outcome("lost", why=f"{status}: not JSON: {text[:200]!r}")
    if status == 200:
        return Outcome("ok", json.dumps(_strip(value), sort_keys=True))
    message = _error_of(value)
    if status in RETRIABLE_HTTP and message:
        return Outcome("refused", why=f"{status}: {message}")
    return Outcome("lost", why=f"{status}: {text[:300]!r}")


def _streamed(status: int, lines: list[tuple[float, bytes]], sent: float) -> Outcome:
    if status != 200:
        return _whole(status, b"".join(line for _, line in lines))
    text, finish, times = [], None, []
    for at, line in lines:
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        if message := _error_of(event):  # the head failed the stream after its status line went out
            return Outcome("refused", why=f"in the stream: {message}")
        for choice in event.get("choices", []):
            if piece := choice.get("delta", {}).get("content"):
                text.append(piece)
                times.append(at)
            finish = choice.get("finish_reason") or finish
    if finish is None:
        return Outcome("lost", why="the stream ended without a finish_reason")
    return Outcome("ok", json.dumps({"text": "".join(text), "finish": finish}),
                   ttft_s=times[0] - sent if times else None, token_times=times)


def send(root: str, name: str, timeout: float = 180.0) -> Outcome:
    """One try of the mix's request `name` through the HTTP API at `root`."""
    path, body, streamed = MIX[name]
    data = json.dumps(body).encode()
    sent = time.monotonic()
    try:
        if streamed:
            return _streamed(*post_stream(root, path, data, timeout), sent)
        return _whole(*post(root, path, data, timeout))
    except (OSError, ValueError) as exc:  # no answer, a cut connection, a malformed stream
        return Outcome("lost", why=f"{type(exc).__name__}: {exc}")
