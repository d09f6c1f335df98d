"""Speculative decoding on the head: draft a few tokens, verify them all in one forward (one ring trip).

Drafts come from prompt lookup (the longest recent n-gram that ends the text so far is searched for earlier in
the prompt and output, and the tokens that followed it are the draft; it costs no model call), or from a
small draft model of the same tokenizer run greedily (draft.py). Verification and
the acceptance rule live in Sampler.verify; rollback needs nothing: the KV cache rows written for rejected
positions lie beyond the accepted length, attention only reads rows [0, pos + T), and the next frame starts at
the first rejected position and overwrites them.
"""

import math
from dataclasses import dataclass
from typing import Protocol

from prima_rpc.request import DEPTH, DRAFT_TOKENS, SPECULATE, check_speculate

# A request that does not say (generate, the clients, HTTP) gets prompt lookup where the ring has no draft model
# (nodes/ring/head.py, Head.default_speculate): measured by tools/bench/bench_speculate.py, 2-3.5x lower TPOT on a
# repeating prompt, the same on ordinary ones (docs/speculation.md). One request at a time goes round
# (DEFAULT_DEPTH) unless it asks for windows in flight (nodes/ring/inflight.py).
# The single-process reference (`run`, GenerateParams) decodes plainly unless asked: it is the oracle.
DEFAULT_MODE = "ngram"
DEFAULT_DRAFT = 4
DEFAULT_DEPTH = 1


@dataclass(frozen=True)
class SpeculateParams:
    mode: str = "off"
    draft_tokens: int = DEFAULT_DRAFT  # the most tokens drafted per trip (the adaptive N stays within it)
    depth: int = DEFAULT_DEPTH  # verify windows in flight round the ring (nodes/ring/inflight.py); 1: one at a time

    def __post_init__(self):
        check_speculate(self.mode, self.draft_tokens, self.depth)
        if self.mode not in SPECULATE or not DRAFT_TOKENS[0] <= self.draft_tokens <= DRAFT_TOKENS[1] \
                or not DEPTH[0] <= self.depth <= DEPTH[1]:
            raise ValueError("speculate, draft_tokens and depth must be set (no empty defaults here)")


def speculate_params(mode: str, draft_tokens: int, depth: int = 0, default_depth: int = DEFAULT_DEPTH,
                     default_draft: int = DEFAULT_DRAFT) -> SpeculateParams:
    """A request's setting from the wire: empty / 0 mean the defaults (depth and draft length: the plan's where
    it chose them, else the head's); anything else is checked (ValueError)."""
    return SpeculateParams(mode or DEFAULT_MODE, draft_tokens or default_draft, depth or default_depth)


class PromptLookup:
    """Prompt lookup over one request's growing context: up to n tokens that followed the latest earlier
    occurrence of the context's longest matching suffix (of min_ngram to max_ngram tokens). Each n-gram is
    indexed once, so a trip costs the same at 4,000 tokens of context as at 40 (a scan took 1 ms there).
    A one-token match is no evidence: on an ordinary chat prompt (SmolLM2) it drafted 21 tokens in 48 and none
    was accepted (tools/bench/bench_speculate.py)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.sizes = range(max_ngram, min_ngram - 1, -1)  # longest first
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence followed by a token
        self.context: list[int] = []  # what is indexed: the context only grows (accepted tokens are appended)

    def __call__(self, context: list[int], n: int) -> list[int]:
        if context[:len(self.context)] != self.context:  # not an extension of the last one: index it afresh
            self.latest, self.context = {}, []
        for g in self.sizes:  # n-grams starting at [len(old) - g, len(context) - g): each now followed by a token
            for start in range(max(0, len(self.context) - g), len(context) - g):
                self.latest[tuple(context[start:start + g])] = start
        self.context = list(context)
        if n <= 0:
            return []
        for g in self.sizes:
            start = self.latest.get(tuple(context[-g:])) if len(context) > g else None
            if start is not None:
                return context[start + g:start + g + n]
        return []


class Drafter(Protocol):
    """A source of draft tokens (nodes/generation/draft.py's DraftModel)."""

    def draft(self, context: list[int], n: int) -> list[int]: ...


class Speculator:
    """One request's drafter, its adaptive draft length and its counts. draft_model: for mode "draft"."""

    def __init__(self, params: SpeculateParams, draft_model: Drafter | None = None):
        if params.mode == "draft" and draft_model is None:
            raise ValueError("speculate=draft needs a draft model (prima-ctl run --draft DIR), and there is none "
                             "here; use speculate=ngram")
        self.params = params
        self.draft_model = draft_model
        self.lookup = PromptLookup()
        self.rate = 1.0  # recent acceptance rate (exponential average), optimistic at first
        self.drafted = 0
        self.accepted = 0

    @property
    def on(self) -> bool:
        return self.params.mode != "off"

    def length(self) -> int:
        """N for the next trip: the cap scaled by the recent acceptance rate, at least 1."""
        return max(1, min(self.params.draft_tokens, math.ceil(self.rate * self.params.draft_tokens)))

    def wanted(self, room: int) -> int:
        """How many tokens to draft next, with room for `room` (0: none)."""
        return min(room, self.length()) if self.on and room > 0 else 0

    def draft(self, context: list[int], room: int) -> list[int]:
        if not (n := self.wanted(room)):
            return []
        if self.draft_model is not None:
            return self.draft_model.draft(context, n)
        return self.lookup(context, n)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            self.rate = 0.5 * self.rate + 0.5 * accepted / drafted
