"""Choosing the next token from logits: greedy, or seeded temperature / top-k / top-p sampling."""

from dataclasses import dataclass

import torch

from prima_rpc.client import TEMPERATURE


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
        p = self.params
        if p.temperature == 0.0:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if 0.0 < p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) > p.top_p  # keep the smallest set reaching top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
