"""One generate request for every client and API dialect: its ranges checked once, its one conversion to the wire.

The CLI, the Python client and the HTTP API build a GenerateRequest (a dialect is a thin adapter that maps its
own field names and error shape onto it); an out-of-range field raises RequestError before anything is sent.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

from prima_rpc.v1 import prima_pb2 as pb

MAX_INT32 = 2**31 - 1  # max_tokens and top_k are int32 on the wire
MAX_TOKENS = (1, MAX_INT32)
TEMPERATURE = (0.0, 2.0)  # 0: greedy; OpenAI's range (beyond 2 sampling is noise)
TOP_K = (0, MAX_INT32)  # 0: off
TOP_P = (0.0, 1.0)  # 1: off
SEED = (0, 2**64 - 1)  # uint64 on the wire
MAX_STOP = 16  # stop strings per request (the head's limit)
SPECULATE = ("off", "ngram", "draft")  # speculative decoding: none, prompt lookup, the head's draft model
DRAFT_TOKENS = (1, 16)  # the most tokens drafted per trip


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


def check_speculate(speculate: str, draft_tokens: int) -> None:
    """RequestError unless a known mode ("" for the head's default) and draft_tokens in range (0: the default)."""
    if speculate and speculate not in SPECULATE:
        raise RequestError("speculate", f"speculate must be one of {', '.join(SPECULATE)}, got {speculate!r}")
    if draft_tokens:
        _check_range("draft_tokens", draft_tokens, DRAFT_TOKENS)


class Message(NamedTuple):
    role: str  # "system", "user", "assistant" (the chat template decides what else it takes)
    content: str


@dataclass(frozen=True)
class GenerateRequest:
    """What the head is asked to generate; the wire's defaults (0, "") mean the head's own."""

    prompt: str = ""  # one user message (or raw text with raw); ignored when messages are given
    messages: tuple[Message, ...] = ()  # a whole chat instead of prompt
    raw: bool = False  # no chat template
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off (0 on the wire, too)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    speculate: str = ""  # "off" | "ngram" | "draft" ("": the head's default)
    draft_tokens: int = 0  # the most tokens drafted per trip (0: the head's default)
    request_id: str = ""  # "": the head makes one

    def __post_init__(self):
        object.__setattr__(self, "messages", tuple(self.messages))  # frozen: lists given become tuples
        object.__setattr__(self, "stop", tuple(self.stop))
        _check_text("prompt", self.prompt, "the prompt")
        for i, m in enumerate(self.messages):
            _check_text(f"messages[{i}]", m.content, "a message")
        _check_range("max_tokens", self.max_tokens, MAX_TOKENS)
        _check_range("temperature", self.temperature, TEMPERATURE)
        _check_range("top_k", self.top_k, TOP_K)
        _check_range("top_p", self.top_p, TOP_P)
        if self.seed is not None and not (_is_int(self.seed) and SEED[0] <= self.seed <= SEED[1]):
            raise RequestError("seed", f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if len(self.stop) > MAX_STOP or not all(self.stop):
            raise RequestError("stop", f"stop: up to {MAX_STOP} non-empty strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            _check_text(f"stop[{i}]", s, "a stop string")
        check_speculate(self.speculate, self.draft_tokens)

    def to_wire(self) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt=self.prompt, messages=[pb.ChatMessage(role=m.role, content=m.content) for m in self.messages],
            raw=self.raw, max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, seed=self.seed, stop=list(self.stop), request_id=self.request_id,
            speculate=self.speculate, draft_tokens=self.draft_tokens)

    @classmethod
    def from_wire(cls, msg: pb.GenerateRequest) -> "GenerateRequest":
        """The request a peer sent; RequestError for what is out of range."""
        return cls(prompt=msg.prompt, messages=tuple(Message(m.role, m.content) for m in msg.messages), raw=msg.raw,
                   max_tokens=msg.max_tokens, temperature=msg.temperature, top_k=msg.top_k,
                   top_p=msg.top_p or 1.0,  # on the wire 0 means off
                   seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
                   speculate=msg.speculate, draft_tokens=msg.draft_tokens, request_id=msg.request_id)


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
