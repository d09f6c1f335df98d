"""A drafter for benchmarks only: it proposes the target's own greedy continuation (recorded by a plain run),
each token corrupted with probability 1 - rate, so a verification accepts about `rate` of what it drafts. It
measures the mechanics of speculation (windows in flight, their cancellation) at a chosen acceptance rate,
free of any draft model's cost.

    python -m tools.bench.replay_drafter NODE ARGS...   # prima-node, whose head drafts by replay

runs prima-node with `speculate=draft` served by this drafter: the node must get `--draft DIR` (any store; it is
not loaded), and $PRIMA_REPLAY names a JSON file {"rate": R, "seed": S, "prompt_tokens": P, "tokens": [...]}:
the prompt's length and its greedy tokens, read afresh by every request (the benchmark rewrites it between runs).
"""

import hashlib
import json
import os
import sys


class ReplayDrafter:
    """Drafts for one request whose prompt has `prompt_tokens` ids and whose greedy output is `tokens`."""

    def __init__(self, prompt_tokens: int, tokens: list[int], rate: float, seed: int = 0):
        self.prompt_tokens, self.tokens, self.rate, self.seed = prompt_tokens, tokens, rate, seed

    def draft(self, context: list[int], n: int) -> list[int]:
        out = []
        for pos in range(len(context), len(context) + n):
            i = pos - self.prompt_tokens
            if not 0 <= i < len(self.tokens):
                break
            token = self.tokens[i]
            if _uniform(self.seed, pos) >= self.rate:  # corrupt this position
                token = (token + 1) % 256  # another byte-level id (every tokenizer here has the first 256)
            out.append(token)
        return out


def _uniform(seed: int, pos: int) -> float:
    """A uniform draw in [0, 1) that depends on (seed, pos) alone: the same position is corrupted in every row."""
    digest = hashlib.blake2b(f"{seed}:{pos}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def from_file(path: str) -> ReplayDrafter:
    with open(path) as f:
        spec = json.load(f)
    return ReplayDrafter(spec["prompt_tokens"], spec["tokens"], spec["rate"], spec.get("seed", 0))


def main() -> None:
    from nodes.ring import head
    from nodes.ring import main as node_main

    path = os.environ["PRIMA_REPLAY"]
    head.load_draft = lambda store, target, dtype=None: None  # nothing to load: the drafter replays
    head.DraftModel = lambda model: from_file(path)
    sys.argv = ["prima-node", *sys.argv[1:]]
    node_main.app()


if __name__ == "__main__":
    main()
