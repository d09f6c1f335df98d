"""Choosing the next token from logits: greedy, or seeded temperature / top-k / top-p / min-p sampling; and the
sampling a request that names no temperature gets (the model's own settings, else DEFAULTS)."""

import math
from dataclasses import dataclass

import torch

from prima_rpc.request import TEMPERATURE


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    min_p: float = 0.0  # 0: off; else tokens below min_p times the likeliest's probability are dropped

    def __post_init__(self):
        if not (TEMPERATURE[0] <= self.temperature <= TEMPERATURE[1]):
            raise ValueError(f"temperature must be in [{TEMPERATURE[0]:g}, {TEMPERATURE[1]:g}], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")


class Sampler:
    """Each output position draws from its own generator, seeded by the request's seed and the position alone: a
    token's draw does not depend on what was drafted before it, nor on where a step began, so a seeded request gives
    the same tokens with speculation on or off, and one resumed on another head goes on with its own stream."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.position = 0  # of the next token this request emits

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [V] float32; the next position's token."""
        token = self._draw(logits, self.position)
        self.position += 1
        return token

    def skip(self, vocab: int) -> None:
        """Past one token that was emitted elsewhere (a resumed request): the next draws are the stream's own."""
        self.position += 1

    def _draw(self, logits: torch.Tensor, position: int) -> int:
        if self.params.temperature == 0.0:  # numpy's argmax: 8 us over 49k logits, torch's 89 (AVX2, one thread)
            return int(logits.numpy().argmax())  # the first of equal maxima, or the first NaN, as torch's
        generator = torch.Generator().manual_seed(_mix(self.seed, position))
        return int(torch.multinomial(self.probs(logits), 1, generator=generator))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from: [V], after temperature, top-k, top-p and min-p."""
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
        if p.min_p > 0.0:  # log p(x) < log p(max) + log min_p, in logits
            logits = logits.masked_fill(logits < logits.max() + math.log(p.min_p), float("-inf"))
        return logits.softmax(-1)

    def verify(self, logits: torch.Tensor, draft: list[int], rows: int | None = None) -> list[int]:
        """The tokens a verification forward yields: the accepted prefix of `draft`, then one of the target's own.

        logits [len(draft) + 1, V], or rows projected as they are read (head_step.RowLogits): row i follows the
        context plus draft[:i], and no row after the first rejection is read. Each row's token is drawn as a plain
        step draws it (its position's own generator; greedy: the argmax), and a draft token is accepted while it
        equals that draw. With the draft a point mass on x this accepts with probability p(x), as the standard
        rejection rule does, and every emitted token is exactly the one the request gives without speculation.
        rows = len(draft): a window in flight whose last row checks the next window's first token; when all match,
        the draft alone comes back (the next window's rows go on from there).
        """
        rows = len(draft) + 1 if rows is None else rows
        out = []
        for i in range(rows):
            out.append(self._draw(logits[i], self.position + i))
            if i == len(draft) or out[-1] != draft[i]:
                break
        self.position += len(out)
        return out


def _mix(seed: int, position: int) -> int:
    """A 63-bit seed for one position (splitmix64's finaliser): neighbouring positions get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0  # OpenAI's: minus this for every token generated at least once
    frequency: float = 0.0  # OpenAI's: minus this times the token's count among the generated
    repetition: float = 1.0  # CTRL's: a seen token's (prompt too) logit divided by it if positive, else times it
    window: int = 0  # the repetition penalty's last tokens (prompt too) that count as seen (0: all of them)

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


# What a request that names no temperature samples with where the model's store gives no settings of its own:
# llama.cpp's common set (its defaults, with its repeat penalty on), which keeps small models out of the loops
# greedy decoding falls into (tools/bench/bench_defaults.py measures that on the default model).
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1,
            "repeat_last_n": 64}
RANGES = {"temperature": (0.0, 2.0), "top_k": (0, 1 << 20), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
          "repeat_penalty": (0.01, 10.0), "repeat_last_n": (0, 1 << 20)}


def model_defaults(settings: dict) -> dict:
    """DEFAULTS with the model's own settings (a store manifest's "sampling") over them: the settings' values that
    are numbers in range, the others ignored (a store's file is data, not a request to refuse)."""
    out = dict(DEFAULTS)
    for name, value in settings.items():
        low, high = RANGES.get(name, (1, 0))
        if isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high:
            out[name] = type(DEFAULTS[name])(value)
    return out
