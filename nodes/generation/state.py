"""One request's token-level state: what to feed the model next, what came out, and when to stop.

Pure (no model, no I/O), so the single-process reference and the ring's head share it exactly.
"""

from dataclasses import dataclass, replace

import torch

from nodes.generation import tool_calls
from nodes.generation.constrain import Constraint, grammar
from nodes.generation.sampling import Penalties, Sampler, SamplingParams, logprobs, model_defaults, penalize
from nodes.generation.speculate import SpeculateParams, Speculator
from nodes.generation.text import PromptError, StreamDecoder, TextCodec
from nodes.generation.tool_stream import CallStream
from prima_rpc.request import GenerateRequest, ToolCall, ToolCallDelta


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    speculate: SpeculateParams = SpeculateParams()
    penalties: Penalties = Penalties()
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # llguidance's grammar the output follows (nodes/generation/constrain.py)
    tools: bool = False  # parse tool calls out of the answer
    model_sampling: bool = False  # the request named no temperature: the model's sampling (with_model_sampling)

    @property
    def shapes_logits(self) -> bool:
        """Whether each token's logits depend on the tokens before it in this request (so no drafts verified)."""
        return self.grammar is not None or not self.penalties.off or self.logprobs

    def __post_init__(self):
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if any(not s for s in self.stop) or len(self.stop) > 16:
            raise ValueError("stop strings must be non-empty, at most 16")


def generate_params(request: GenerateRequest, speculate: SpeculateParams,
                    family: str = tool_calls.GENERIC) -> GenerateParams:
    """A checked request's generation parameters (its ranges were checked when it was made); `speculate` is
    the caller's choice of default (the head's: prompt lookup; the reference's: as asked); `family`: the
    model's tool-call markup (tool_calls.family of its chat template)."""
    return GenerateParams(
        max_tokens=request.max_tokens, stop=request.stop, speculate=speculate,
        sampling=SamplingParams(request.temperature or 0.0, request.top_k, request.top_p, request.seed),
        model_sampling=request.temperature is None,
        penalties=Penalties(request.presence_penalty, request.frequency_penalty, request.repetition_penalty),
        logprobs=request.logprobs or request.top_logprobs > 0, top_logprobs=request.top_logprobs,
        grammar=grammar(request, family), tools=bool(request.tools) and request.tool_choice != "none")


def with_model_sampling(params: GenerateParams, settings: dict) -> GenerateParams:
    """`params` of a request that named no temperature, with the model's sampling (its store's settings over
    sampling.DEFAULTS) where the request left a value at its default (top_k 0, top_p 1, repetition penalty 1)."""
    d = model_defaults(settings)
    s, pen = params.sampling, params.penalties
    sampling = SamplingParams(d["temperature"], s.top_k or d["top_k"], s.top_p if s.top_p < 1.0 else d["top_p"],
                              s.seed, d["min_p"])
    repetition = pen.repetition if pen.repetition != 1.0 else d["repeat_penalty"]
    return replace(params, sampling=sampling, penalties=replace(pen, repetition=repetition, window=d["repeat_last_n"]),
                   model_sampling=False)


@dataclass(frozen=True)
class TokenOut:
    token_id: int
    text: str  # text this token adds (may be empty: partial character, held stop prefix, EOS)
    index: int
    logprob: float | None = None  # with logprobs: log p of this token
    top: tuple[tuple[int, float], ...] = ()  # with top_logprobs: (token, log p), likeliest first
    calls: tuple[ToolCallDelta, ...] = ()  # with tools: what this token adds to the calls (held back from text)


@dataclass(frozen=True)
class Prefilled:
    """A long prompt's progress: `done` of its `total` tokens have gone through every layer."""

    done: int
    total: int


class Generation:
    def __init__(self, prompt_ids: list[int], params: GenerateParams, codec: TextCodec,
                 eos_ids: tuple[int, ...], max_seq: int, spec: Speculator | None = None, vocab: int = 0):
        """vocab: the model's (its logits' length; 0: the tokenizer's)."""
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) >= max_seq:
            raise PromptError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {max_seq}")
        self.prompt_ids = list(prompt_ids)
        if params.model_sampling:
            params = with_model_sampling(params, codec.manifest.sampling)
        self.params = params
        self.max_tokens = min(params.max_tokens, max_seq - len(prompt_ids))
        self.capacity = len(prompt_ids) + self.max_tokens  # KV-cache length this request needs
        self.sampler = Sampler(params.sampling)
        self.spec = spec or Speculator(params.speculate)  # drafter and drafted / accepted counts
        self.decoder = StreamDecoder(codec)
        self.eos_ids = set(eos_ids)
        self.tokens: list[int] = []
        self.text = ""
        self._held = ""  # text that may be the start of a stop string
        self.finish_reason: str | None = None
        self.trips = 0  # ring trips (on a ring's head): the prompt's last, then every verify window sent
        self.tool_calls: list[ToolCall] = []
        self._tool_text = ""  # with tools: text held back, as it may be (or is: _calling) a tool call
        self._calling = False
        self._stream = CallStream()  # the held call text read as it grows, into ToolCallDelta
        self._deltas: list[ToolCallDelta] = []
        self.constraint = Constraint(params.grammar, codec, vocab or codec.tokenizer.get_vocab_size()) \
            if params.grammar else None
        self.counts: torch.Tensor | None = None  # with penalties: each token's count among the generated [V]
        self.seen: torch.Tensor | None = None  # and whether it is in the prompt or generated, bool [V]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def pending(self) -> tuple[list[int], int]:
        """Token ids to run next and the position of the first one."""
        if not self.tokens:
            return self.prompt_ids, 0
        return self.tokens[-1:], len(self.prompt_ids) + len(self.tokens) - 1

    def draft_room(self) -> int:
        """How many drafted tokens the next forward may verify: none before the first token (the prompt runs
        alone), and none beyond the tokens this request may still emit (so positions stay inside its KV)."""
        return max(0, self.max_tokens - len(self.tokens) - 1) if self.tokens else 0

    def draft(self, drafted: list[int] = ()) -> list[int]:
        """Tokens to verify after pending()'s in the same forward (none when speculation is off or finds none);
        drafted: tokens already drafted after those (windows in flight), which these then follow."""
        if self.params.shapes_logits:
            return []
        return self.spec.draft(self.prompt_ids + self.tokens + list(drafted), self.draft_room() - len(drafted))

    def draft_ask(self, drafted: list[int] = ()) -> tuple[list[int], int]:
        """What draft() asks its drafter: the context and how many tokens (0: none), for one drafting elsewhere."""
        if self.params.shapes_logits:
            return [], 0
        return self.prompt_ids + self.tokens + list(drafted), self.spec.wanted(self.draft_room() - len(drafted))

    def accept(self, logits: torch.Tensor) -> TokenOut:
        """Sample from the last position's logits [V] (after penalties and the grammar's mask) and advance."""
        p = self.params
        if not p.penalties.off:
            if self.counts is None:  # sized by the logits: the model's vocabulary may pass the tokenizer's
                self.counts = torch.zeros(logits.numel())
                self.counts.index_add_(0, torch.tensor(self.tokens, dtype=torch.long), torch.ones(len(self.tokens)))
                self.seen = torch.zeros(logits.numel(), dtype=torch.bool)
                self.seen[torch.tensor(self.prompt_ids + self.tokens)] = True
            logits = penalize(logits, self.counts, self._recent() if p.penalties.window else self.seen, p.penalties)
        if self.constraint is not None:
            logits = self.constraint.mask(logits, self.max_tokens - len(self.tokens))
        token = self.sampler(logits)
        if self.constraint is not None and token not in self.eos_ids:
            self.constraint.advance(token)
        out = self._push(token)
        if p.logprobs:
            lp, top = logprobs(logits, token, p.top_logprobs)
            out = replace(out, logprob=lp, top=tuple(top))
        return out

    def _recent(self) -> torch.Tensor:
        """bool [V]: the tokens among the repetition penalty's window of the last ones (prompt too)."""
        seen = torch.zeros_like(self.seen)
        seen[torch.tensor((self.prompt_ids + self.tokens)[-self.params.penalties.window:])] = True
        return seen

    def accept_draft(self, logits: torch.Tensor, draft: list[int], rows: int | None = None) -> list[TokenOut]:
        """Verify `draft` against logits [len(draft) + 1, V] of pending() + draft; emit the accepted prefix and
        the target's next token (fewer if one of them ends the request). rows = len(draft): a window in flight,
        whose draft ends with the next window's first token; all accepted, no token of the target's own follows."""
        outs = []
        tokens = self.sampler.verify(logits, draft, rows)
        for token in tokens:
            outs.append(self._push(token))
            if self.done:
                break
        whole = len(tokens) == len(draft) and tokens == draft
        self.spec.update(len(draft), min(len(tokens) - (0 if whole else 1), len(outs)))
        return outs

    def resume(self, tokens: list[int], vocab: int) -> None:
        """Continue after `tokens` that a broken stream already gave (the head failed over): each is taken as if
        sampled here, and a seeded sampler moves past its position, so it goes on with its own stream (each position
        draws alone: also with speculation). ValueError: a token outside the vocabulary, or more than the request
        may emit."""
        for token in tokens:
            if not 0 <= token < vocab or self.done:
                raise ValueError(f"resume_tokens: {len(tokens)} tokens do not continue this request "
                                 f"(ids in [0, {vocab}), at most {self.max_tokens}, none after its end)")
            self.sampler.skip(vocab)
            if self.constraint is not None and token not in self.eos_ids:  # the grammar goes on where it was
                self.constraint.advance(token)
            self._push(token)

    def _push(self, token: int) -> TokenOut:
        assert not self.done, "generation already finished"
        self.tokens.append(token)
        if self.counts is not None:
            self.counts[token] += 1
            self.seen[token] = True
        if token in self.eos_ids:
            piece = self._flush()
            self.finish_reason = "stop"
        else:
            piece = self._stop_filter(self.decoder.push(token))
            if not self.done and len(self.tokens) >= self.max_tokens:
                piece += self._flush()
                self.finish_reason = "length"
        if self.params.tools:
            piece = self._hold_calls(piece)
        self.text += piece
        deltas, self._deltas = tuple(self._deltas), []
        return TokenOut(token, piece, len(self.tokens) - 1, calls=deltas)

    def _hold_calls(self, piece: str) -> str:
        """Text up to where a tool call may begin; from there on held (read as it grows into the token's call
        deltas), and at the end parsed into tool_calls (finish_reason "tool_calls") or, if it holds none and none
        was streamed, handed out after all."""
        buf, out = (self._tool_text or "") + piece, ""
        if not self._calling:
            answer = self.text + buf
            at = max(tool_calls.opens_call(answer), len(self.text))
            if at < len(answer):
                self._calling, out, buf = True, answer[len(self.text):at], answer[at:]
            else:  # hold what may be the start of a call's markup
                keep = tool_calls.partial_marker(answer)
                out, buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self._tool_text = buf
        if self._calling:
            self._deltas = self._stream.feed(buf)
        if not self.done:
            return out
        self._tool_text = ""
        content, calls, complete = self._stream.finish(buf) if self._calling else (buf, [], False)
        self.tool_calls = calls
        if complete:
            self.finish_reason = "tool_calls"
        return out + content

    def _flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _stop_filter(self, piece: str) -> str:
        """Emit text up to a stop string (and end), holding back a possible stop-string prefix."""
        if not self.params.stop:
            return piece
        buf = self._held + piece
        hits = [i for i in (buf.find(s) for s in self.params.stop) if i >= 0]
        if hits:
            self._held, self.finish_reason = "", "stop"
            return buf[:min(hits)]
        keep = max((n for s in self.params.stop for n in range(1, len(s)) if buf.endswith(s[:n])), default=0)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]
