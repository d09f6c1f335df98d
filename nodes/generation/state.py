"""One request's token-level state: what to feed the model next, what came out, and when to stop.

Pure (no model, no I/O), so the single-process reference and the ring's head share it exactly.
"""

from dataclasses import dataclass

import torch

from nodes.generation.sampling import Sampler, SamplingParams
from nodes.generation.speculate import SpeculateParams, Speculator
from nodes.generation.text import PromptError, StreamDecoder, TextCodec
from prima_rpc.request import GenerateRequest


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    speculate: SpeculateParams = SpeculateParams()

    def __post_init__(self):
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if any(not s for s in self.stop) or len(self.stop) > 16:
            raise ValueError("stop strings must be non-empty, at most 16")


def generate_params(request: GenerateRequest, speculate: SpeculateParams) -> GenerateParams:
    """A checked request's generation parameters (its ranges were checked when it was made); `speculate` is
    the caller's choice of default (the head's: prompt lookup; the reference's: as asked)."""
    return GenerateParams(max_tokens=request.max_tokens, stop=request.stop, speculate=speculate,
                          sampling=SamplingParams(request.temperature, request.top_k, request.top_p, request.seed))


@dataclass(frozen=True)
class TokenOut:
    token_id: int
    text: str  # text this token adds (may be empty: partial character, held stop prefix, EOS)
    index: int


class Generation:
    def __init__(self, prompt_ids: list[int], params: GenerateParams, codec: TextCodec,
                 eos_ids: tuple[int, ...], max_seq: int, spec: Speculator | None = None):
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) >= max_seq:
            raise PromptError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {max_seq}")
        self.prompt_ids = list(prompt_ids)
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

    def draft(self) -> list[int]:
        """Tokens to verify after pending()'s in the same forward (none when speculation is off or finds none)."""
        return self.spec.draft(self.prompt_ids + self.tokens, self.draft_room())

    def accept(self, logits: torch.Tensor) -> TokenOut:
        """Sample from the last position's logits [V] and advance."""
        return self._push(self.sampler(logits))

    def accept_draft(self, logits: torch.Tensor, draft: list[int]) -> list[TokenOut]:
        """Verify `draft` against logits [len(draft) + 1, V] of pending() + draft; emit the accepted prefix and
        the target's next token (fewer if one of them ends the request)."""
        outs = []
        tokens = self.sampler.verify(logits, draft)
        for token in tokens:
            outs.append(self._push(token))
            if self.done:
                break
        self.spec.update(len(draft), min(len(tokens) - 1, len(outs)))
        return outs

    def resume(self, tokens: list[int], vocab: int) -> None:
        """Continue after `tokens` that a broken stream already gave (the head failed over): each is taken as if
        sampled here, and a seeded sampler draws once for each, so it goes on with its own stream (exact when
        nothing was speculated). ValueError: a token outside the vocabulary, or more than the request may emit."""
        for token in tokens:
            if not 0 <= token < vocab or self.done:
                raise ValueError(f"resume_tokens: {len(tokens)} tokens do not continue this request "
                                 f"(ids in [0, {vocab}), at most {self.max_tokens}, none after its end)")
            self.sampler.skip(vocab)
            self._push(token)

    def _push(self, token: int) -> TokenOut:
        assert not self.done, "generation already finished"
        self.tokens.append(token)
        if token in self.eos_ids:
            piece = self._flush()
            self.finish_reason = "stop"
        else:
            piece = self._stop_filter(self.decoder.push(token))
            if not self.done and len(self.tokens) >= self.max_tokens:
                piece += self._flush()
                self.finish_reason = "length"
        self.text += piece
        return TokenOut(token, piece, len(self.tokens) - 1)

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
