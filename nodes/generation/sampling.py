"""Choosing the next token from logits: greedy, or seeded temperature / top-k / top-p sampling."""

from dataclasses import dataclass

import torch

from prima_rpc.request import TEMPERATURE


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self):
        if not (TEMPERATURE[0] <= self.temperature <= TEMPERATURE[1]):
            raise ValueError(f"temperature must be in [{TEMPERATURE[0]:g}, {TEMPERATURE[1]:g}], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [V] float32."""
        if self.params.temperature == 0.0:
            return int(logits.argmax())
        return int(torch.multinomial(self.probs(logits), 1, generator=self.generator))

    def skip(self, vocab: int) -> None:
        """Advance the generator past one sampled token: multinomial of one draws `vocab` exponentials whatever the
        probabilities, so a resumed request continues its own sample stream."""
        if self.params.temperature != 0.0:
            torch.multinomial(torch.ones(vocab), 1, generator=self.generator)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from: [V], after temperature, top-k and top-p."""
        p = self.params
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if 0.0 < p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) > p.top_p  # keep the smallest set reaching top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return logits.softmax(-1)

    def verify(self, logits: torch.Tensor, draft: list[int]) -> list[int]:
        """The tokens a verification forward yields: the accepted prefix of `draft`, then one of the target's own.

        logits [len(draft) + 1, V]: row i follows the context plus draft[:i]. Greedy accepts while the draft
        equals the argmax. Sampling uses the standard rejection rule with the draft a point mass q = 1{x}:
        accept x with probability p(x); on rejection sample from max(0, p - q) normalised, i.e. p without x;
        so every emitted token is distributed exactly as the target model's p.
        """
        out = []
        for i, x in enumerate(draft):
            if self.params.temperature == 0.0:
                token = int(logits[i].argmax())
                out.append(token)
                if token != x:
                    return out
                continue
            p = self.probs(logits[i])
            if float(torch.rand((), generator=self.generator)) < float(p[x]):
                out.append(x)
                continue
            residual = p.clone()
            residual[x] = 0.0  # p(x) < 1 here, so something is left
            out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=self.generator)))
            return out
        out.append(self(logits[len(draft)]))
        return out


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0  # OpenAI's: minus this for every token generated at least once
    frequency: float = 0.0  # OpenAI's: minus this times the token's count among the generated
    repetition: float = 1.0  # CTRL's: a seen token's (prompt too) logit divided by it if positive, else times it

    @property
    def off(self) -> bool:
        return self.presence == 0.0 and self.frequency == 0.0 and self.repetition == 1.0


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, p: Penalties) -> torch.Tensor:
    """logits [V] after the penalties; counts [V]: each token's count among the generated; seen bool [V]: in the
    prompt or generated."""
    if p.repetition != 1.0:
        logits = torch.where(seen, torch.where(logits > 0, logits / p.repetition, logits * p.repetition), logits)
    return logits - p.frequency * counts - p.presence * (counts > 0).float()


def logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log p of `token`, the `top` likeliest tokens and theirs, likeliest first) under softmax(logits [V]): the
    distribution after penalties and grammar, at temperature 1 (so greedy picks the first of the top)."""
    lp = torch.log_softmax(logits.float(), -1)
    if not top:
        return float(lp[token]), []
    values, ids = torch.topk(lp, min(top, lp.numel()))
    return float(lp[token]), [(int(i), float(v)) for i, v in zip(ids, values) if v > float("-inf")]
