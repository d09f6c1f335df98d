"""One generate request for every client and API dialect: its ranges checked once, its one conversion to the wire.

The CLI, the Python client and the HTTP API build a GenerateRequest (a dialect is a thin adapter that maps its
own field names and error shape onto it); an out-of-range field raises RequestError before anything is sent.
"""

import json
import math
from dataclasses import dataclass
from typing import NamedTuple

from prima_rpc.spec.speculation import DEPTH, DRAFT_TOKENS  # noqa: F401 (re-exported: callers import them here)
from prima_rpc.v1 import prima_pb2 as pb

MAX_INT32 = 2**31 - 1  # max_tokens and top_k are int32 on the wire
MAX_TOKENS = (1, MAX_INT32)
TEMPERATURE = (0.0, 2.0)  # 0: greedy; OpenAI's range (beyond 2 sampling is noise)
TOP_K = (0, MAX_INT32)  # 0: off
TOP_P = (0.0, 1.0)  # 1: off
SEED = (0, 2**64 - 1)  # uint64 on the wire
MAX_STOP = 16  # stop strings per request (the head's limit)
SPECULATE = ("off", "ngram", "draft")  # speculative decoding: none, prompt lookup, the head's draft model

PENALTY = (-2.0, 2.0)  # presence and frequency penalties: OpenAI's range
REPETITION_PENALTY = (0.0, 10.0)  # CTRL's divisor; 1 (or 0 on the wire): off; 0 itself is refused
TOP_LOGPROBS = (0, 20)  # OpenAI's most alternatives per position
RESPONSE_FORMATS = ("", "text", "json_object", "json_schema")
TOOL_CHOICES = ("", "auto", "none", "required")  # or the name of one of the tools
MAX_TOOLS = 128
# chat_template_kwargs: names the template gets from the head itself, and how long the JSON may be
TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
MAX_TEMPLATE_KWARGS = 4096


class RequestError(ValueError):
    """A field the head would refuse. `field` names it as GenerateRequest does: "max_tokens", "stop", ..., and
    with an index for one text among several ("messages[2]", "stop[0]")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_text(value: str, what: str) -> str:
    """`value` if it can go on the wire as UTF-8 (a command line with undecodable bytes cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start].encode("utf-8", "surrogateescape")
        raise ValueError(f"{what} is not valid UTF-8 text (byte 0x{bad.hex()} at character {exc.start}); "
                         "re-encode it as UTF-8") from None
    return value


def check_speculate(speculate: str, draft_tokens: int, depth: int = 0) -> None:
    """RequestError unless a known mode ("" for the head's default), draft_tokens and depth in range (0: the
    default)."""
    if speculate and speculate not in SPECULATE:
        raise RequestError("speculate", f"speculate must be one of {', '.join(SPECULATE)}, got {speculate!r}")
    if draft_tokens:
        _check_range("draft_tokens", draft_tokens, DRAFT_TOKENS)
    if depth:
        _check_range("depth", depth, DEPTH)


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # JSON text of an object


class ToolCallDelta(NamedTuple):
    """A piece of call `index` as it is generated: its id and name first, then its arguments' text in pieces."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class Tool(NamedTuple):
    name: str
    description: str = ""
    parameters: str = ""  # JSON text of a JSON Schema ("": any object)


class Message(NamedTuple):
    role: str  # "system", "user", "assistant", "tool" (the chat template decides what else it takes)
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls, in a history
    tool_call_id: str = ""  # role "tool": the call answered
    name: str = ""  # role "tool": the function that answered


@dataclass(frozen=True)
class GenerateRequest:
    """What the head is asked to generate; the wire's defaults (0, "") mean the head's own."""

    prompt: str = ""  # one user message (or raw text with raw); ignored when messages are given
    messages: tuple[Message, ...] = ()  # a whole chat instead of prompt
    raw: bool = False  # no chat template
    max_tokens: int = 128
    temperature: float | None = 0.0  # 0: greedy; None: the model's sampling (its own settings, else the head's)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off (0 on the wire, too)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    speculate: str = ""  # "off" | "ngram" | "draft" ("": the head's default)
    draft_tokens: int = 0  # the most tokens drafted per trip (0: the head's default)
    depth: int = 0  # speculative windows in flight round the ring (1: one at a time; 0: the plan's or the head's)
    request_id: str = ""  # "": the head makes one
    presence_penalty: float = 0.0  # OpenAI's: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times its count so far
    repetition_penalty: float = 1.0  # CTRL's: logits of tokens seen (prompt too) divided (or times, if < 0) by it
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position (with logprobs)
    response_format: str = ""  # "" | "text": free; "json_object" | "json_schema": the output is that JSON
    json_schema: str = ""  # JSON text, with response_format "json_schema"
    tools: tuple[Tool, ...] = ()
    tool_choice: str = ""  # "" or "auto": the model decides; "none"; "required"; or one tool's name
    chat_template_kwargs: str = ""  # JSON object: more variables for the chat template ({"enable_thinking": false})

    def __post_init__(self):
        object.__setattr__(self, "messages", tuple(self.messages))  # frozen: lists given become tuples
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "tools", tuple(self.tools))
        _check_text("prompt", self.prompt, "the prompt")
        for i, m in enumerate(self.messages):
            _check_text(f"messages[{i}]", m.content, "a message")
        _check_range("max_tokens", self.max_tokens, MAX_TOKENS)
        if self.temperature is not None:
            _check_range("temperature", self.temperature, TEMPERATURE)
        _check_range("top_k", self.top_k, TOP_K)
        _check_range("top_p", self.top_p, TOP_P)
        if self.seed is not None and not (_is_int(self.seed) and SEED[0] <= self.seed <= SEED[1]):
            raise RequestError("seed", f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if len(self.stop) > MAX_STOP or not all(self.stop):
            raise RequestError("stop", f"stop: up to {MAX_STOP} non-empty strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            _check_text(f"stop[{i}]", s, "a stop string")
        check_speculate(self.speculate, self.draft_tokens, self.depth)
        self._check_sampling()
        self._check_output()

    def _check_sampling(self) -> None:
        _check_range("presence_penalty", self.presence_penalty, PENALTY)
        _check_range("frequency_penalty", self.frequency_penalty, PENALTY)
        _check_range("repetition_penalty", self.repetition_penalty, REPETITION_PENALTY)
        if self.repetition_penalty == 0.0:
            raise RequestError("repetition_penalty", "repetition_penalty must be > 0 (1: off), got 0")
        _check_range("top_logprobs", self.top_logprobs, TOP_LOGPROBS)

    def _check_output(self) -> None:
        """The response format and the tools: known names, schemas that are JSON objects."""
        if self.response_format not in RESPONSE_FORMATS:
            raise RequestError("response_format", f"response_format must be one of text, json_object, json_schema, "
                                                  f"got {self.response_format!r}")
        if (self.response_format == "json_schema") != bool(self.json_schema):
            raise RequestError("json_schema", "a json_schema goes with response_format json_schema, and only there")
        if self.json_schema:
            _check_json_object("json_schema", self.json_schema)
        if len(self.tools) > MAX_TOOLS:
            raise RequestError("tools", f"tools: at most {MAX_TOOLS}, got {len(self.tools)}")
        names = [t.name for t in self.tools]
        for i, t in enumerate(self.tools):
            if not t.name or t.name in names[:i]:
                raise RequestError(f"tools[{i}]", f"tools[{i}]: each tool needs a name of its own, got {t.name!r}")
            if t.parameters:
                _check_json_object(f"tools[{i}]", t.parameters)
        if self.tool_choice not in TOOL_CHOICES and self.tool_choice not in names:
            raise RequestError("tool_choice", f"tool_choice must be auto, none, required or the name of a tool, "
                                              f"got {self.tool_choice!r}")
        if self.tool_choice == "required" and not self.tools:
            raise RequestError("tool_choice", "tool_choice required needs tools")
        if self.response_format in ("json_object", "json_schema") and self.forced_tool:
            raise RequestError("response_format", "a JSON response format cannot go with a forced tool call")
        for i, m in enumerate(self.messages):
            for c in m.tool_calls:
                _check_json_object(f"messages[{i}]", c.arguments or "{}")
        if self.chat_template_kwargs:
            self._check_template_kwargs()

    def _check_template_kwargs(self) -> None:
        field = "chat_template_kwargs"
        if self.raw:
            raise RequestError(field, "chat_template_kwargs go with the chat template; a raw prompt has none")
        if len(self.chat_template_kwargs) > MAX_TEMPLATE_KWARGS:
            raise RequestError(field, f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} characters of JSON, "
                                      f"got {len(self.chat_template_kwargs)}")
        _check_json_object(field, self.chat_template_kwargs)
        for name in json.loads(self.chat_template_kwargs):
            if not name.isidentifier() or name in TEMPLATE_OWN:
                raise RequestError(field, f"chat_template_kwargs: {name!r} is not a variable a request may set "
                                          f"(names, not {', '.join(TEMPLATE_OWN)})")

    def template_kwargs(self) -> dict:
        """chat_template_kwargs as the template's variables (checked: a JSON object of names)."""
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    @property
    def forced_tool(self) -> bool:
        """Whether the model must call a tool (tool_choice required, or one named)."""
        return bool(self.tools) and self.tool_choice not in ("", "auto", "none")

    def to_wire(self) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt=self.prompt, messages=[_message_to_wire(m) for m in self.messages],
            raw=self.raw, max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, seed=self.seed, stop=list(self.stop), request_id=self.request_id,
            speculate=self.speculate, draft_tokens=self.draft_tokens, depth=self.depth,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs, top_logprobs=self.top_logprobs, response_format=self.response_format,
            json_schema=self.json_schema, tool_choice=self.tool_choice, chat_template_kwargs=self.chat_template_kwargs,
            tools=[pb.Tool(name=t.name, description=t.description, parameters=t.parameters) for t in self.tools])

    @classmethod
    def from_wire(cls, msg: pb.GenerateRequest) -> "GenerateRequest":
        """The request a peer sent; RequestError for what is out of range."""
        return cls(prompt=msg.prompt, messages=tuple(_message_from_wire(m) for m in msg.messages), raw=msg.raw,
                   max_tokens=msg.max_tokens, temperature=msg.temperature if msg.HasField("temperature") else None,
                   top_k=msg.top_k,
                   top_p=msg.top_p or 1.0,  # on the wire 0 means off
                   seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
                   speculate=msg.speculate, draft_tokens=msg.draft_tokens, depth=msg.depth,
                   request_id=msg.request_id,
                   presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                   repetition_penalty=msg.repetition_penalty or 1.0, logprobs=msg.logprobs,
                   top_logprobs=msg.top_logprobs, response_format=msg.response_format, json_schema=msg.json_schema,
                   tools=tuple(Tool(t.name, t.description, t.parameters) for t in msg.tools),
                   tool_choice=msg.tool_choice, chat_template_kwargs=msg.chat_template_kwargs)


def _message_to_wire(m: Message) -> pb.ChatMessage:
    return pb.ChatMessage(role=m.role, content=m.content, tool_call_id=m.tool_call_id, name=m.name,
                          tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls])


def _message_from_wire(m: pb.ChatMessage) -> Message:
    return Message(m.role, m.content, tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                   m.tool_call_id, m.name)


def _check_json_object(field: str, text: str) -> None:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise RequestError(field, f"{field}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RequestError(field, f"{field}: a JSON object is expected, got {text[:40]}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(field: str, value, bounds: tuple[int, int] | tuple[float, float]) -> None:
    lo, hi = bounds
    if isinstance(lo, float):  # a number: ints are numbers too
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        shown = f"[{lo:g}, {hi:g}]"
    else:
        ok, shown = _is_int(value), f"[{lo}, {hi}]"
    if not (ok and lo <= value <= hi):
        raise RequestError(field, f"{field} must be in {shown}, got {value}")


def _check_text(field: str, value: str, what: str) -> None:
    try:
        check_text(value, what)
    except ValueError as exc:
        raise RequestError(field, str(exc)) from None
