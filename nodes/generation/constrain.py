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

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar takes next (only EOS once it is complete)."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        return ((words[:, None] >> self._bits) & 1).flatten()[:self.vocab].bool()  # little-endian bit order

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar refuses at -inf."""
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            if self.matcher.is_error():  # a schema the parser gives up on mid-answer (one that recurses forever)
                raise PromptError(f"the output format cannot be followed: {self.matcher.get_error()[:300]}")
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
