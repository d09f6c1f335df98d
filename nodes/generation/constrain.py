"""Constrained decoding with llguidance: a request's JSON formats and tool calls as a grammar, and the token mask it
puts on the logits where the head samples (the ring is unchanged).

llguidance was chosen by measurement (tools/bench/bench_grammar.py, docs/http-api.md): on SmolLM2's 49k-token
vocabulary its mask takes ~15 us a token, it covers the most of JSON Schema of the three libraries on PyPI, and it
reads tokenizer.json itself (no transformers at run time).
"""

import json
import weakref

import llguidance
import torch

from nodes.generation import tool_calls
from nodes.generation.text import PromptError, TextCodec
from prima_rpc.request import GenerateRequest, Tool

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a small model cannot wander off in whitespace
# Closing an answer within its token budget: the tokens a closing prefers, in order. '"' first: inside a string it
# ends it (where '}' would be more of its text), where a value is due it starts the empty string; then the ends of
# containers and the shortest values.
CLOSERS = ('"', '}', ']', '0', 'null', 'true', 'false', '[', '{')
LOOKAHEAD = 64  # closings are planned in the last 64 tokens of a budget
REPLAN = 4  # tokens between two plans while far from closing
SLACK = 4  # a closing starts while its plan is this many tokens short of the budget: one free token can lengthen it
_TOKENIZERS: "weakref.WeakKeyDictionary[TextCodec, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()


def grammar(request: GenerateRequest, family: str) -> str | None:
    """The llguidance grammar a request's output must follow, None for free text. Forced tool calls (required, or
    one named) must be one call in the family's markup; with tool_choice auto the text is free until the model opens
    a call, whose arguments then follow the tool's schema."""
    if request.response_format == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if request.response_format == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(request.json_schema, defaults=JSON_OPTIONS)
    if not request.tools or request.tool_choice == "none":
        return None
    trigger, begin, key, end = tool_calls.MARKUP[family]
    if request.forced_tool:
        tools = [t for t in request.tools if request.tool_choice in ("required", t.name)]
        return _forced_call(tools, begin.removesuffix('{"name": '), key, end.removeprefix("}"))
    tags = [llguidance.StructTag(trigger=trigger, begin=f"{begin}{json.dumps(t.name)}, \"{key}\": ",
                                 grammar=_arguments_schema(t), end=end) for t in request.tools]
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def _forced_call(tools: list[Tool], opener: str, key: str, closer: str) -> str:
    schema = {"anyOf": [tool_calls.call_schema(t, key) for t in tools]}
    body = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    return f"start: {json.dumps(opener)} call {json.dumps(closer)}\ncall: %json {body}\n"


def _arguments_schema(tool: Tool) -> dict:
    return {**tool_calls.parameters(tool), "x-guidance": JSON_OPTIONS}


def tokenizer(codec: TextCodec, vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of the store's tokenizer (~0.2 s to build, so one per codec)."""
    if codec not in _TOKENIZERS:
        eos = list(codec.manifest.eos_token_ids)
        _TOKENIZERS[codec] = llguidance.LLTokenizer(codec.tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
    return _TOKENIZERS[codec]


class Constraint:
    """One request's grammar state: mask() the logits before sampling, then advance() by the token chosen."""

    def __init__(self, grammar_text: str, codec: TextCodec, vocab: int):
        self.matcher = llguidance.LLMatcher(tokenizer(codec, vocab), grammar_text, log_level=0)
        if self.matcher.is_error():
            raise PromptError(f"the output format cannot be followed: {self.matcher.get_error()}")
        self.vocab = vocab
        self._bits = torch.arange(8, dtype=torch.uint8)
        self.eos = set(codec.manifest.eos_token_ids)
        ids = (codec.tokenizer.token_to_id(s) for s in CLOSERS)
        self.closers = [i for i in ids if i is not None and i < vocab]
        self._planned: tuple[int, int | None] = (0, 0)  # (tokens left, the closing's length) when last planned
        self._closing: list[int] = []  # a closing under way: its tokens still to come

    def allowed(self, matcher: "llguidance.LLMatcher | None" = None) -> torch.Tensor:
        """bool [V]: the tokens the grammar takes next (only EOS once it is complete)."""
        words = torch.frombuffer(bytearray((matcher or self.matcher).compute_bitmask()), dtype=torch.uint8)
        return ((words[:, None] >> self._bits) & 1).flatten()[:self.vocab].bool()  # little-endian bit order

    def mask(self, logits: torch.Tensor, left: int | None = None) -> torch.Tensor:
        """logits [V] with every token the grammar refuses at -inf; left: the tokens the request may still emit,
        this one included. Near the end of that budget the answer is closed: only the next token of the
        shortest closing found is left, so a JSON answer or a tool call that the budget would cut ends complete."""
        if self._closing:  # closing: its tokens one by one (the plan holds, as each is the one taken)
            return self._only(logits, self._closing.pop(0))
        if left is not None and left <= LOOKAHEAD and self._replan(left) and not self.matcher.is_accepting():
            plan = self.closing(left)
            self._planned = (left, len(plan) if plan else None)
            if plan and len(plan) + SLACK >= left:
                self._closing = plan[1:]
                return self._only(logits, plan[0])
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def _replan(self, left: int) -> bool:
        """Whether to look for a closing now: near the last one's length (it grows by a few tokens at a step), and
        every REPLAN tokens besides; every other token while none fitted (the model's own tokens may close in
        fewer than the greedy plan's)."""
        at, length = self._planned
        if at and length is None:
            return at - left >= 2
        return not at or left <= length + SLACK + REPLAN or at - left >= REPLAN

    @staticmethod
    def _only(logits: torch.Tensor, token: int) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[token] = logits[token]
        return out

    def closing(self, limit: int) -> list[int] | None:
        """The tokens of a short way from here to a complete answer (greedy: at each step the tokens the grammar
        forces, else the first of CLOSERS it takes, else its first token that is not EOS), None if none within
        `limit` tokens."""
        m = self.matcher.deep_copy()
        plan: list[int] = []
        while not m.is_accepting():
            if len(plan) >= limit or m.is_error():
                return None
            forced = m.compute_ff_tokens()  # what the grammar fixes from here (a key's name), as the model's tokens
            if forced:
                if not m.consume_tokens(forced):
                    return None
                plan += forced
                continue
            allowed = self.allowed(m)
            token = next((t for t in self.closers if allowed[t]), None)
            if token is None:
                token = next((int(t) for t in allowed.nonzero().flatten() if int(t) not in self.eos), None)
            if token is None or not m.consume_token(token):
                return None
            plan.append(token)
        return plan

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            if self.matcher.is_error():  # a schema the parser gives up on mid-answer (one that recurses forever)
                raise PromptError(f"the output format cannot be followed: {self.matcher.get_error()[:300]}")
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
