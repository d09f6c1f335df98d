"""TTFT of a chat's second turn after a long system prompt, cold vs from the prefix cache (issue 29).

    python -m tools.bench.bench_prefix [--system-tokens 1500] [--repeats 3] [--json]

Starts a 3-node loopback ring of the default model (SmolLM2, windows 10/10/10). Each repeat uses its own system
prompt (so nothing is cached from the repeat before): turn 1 runs it once, then turn 2 (turn 1 + the answer + a
new question) is timed twice: cold on a fresh re-plan (which drops every node's prefixes: the nodes run with
--prefix-disk 0) and cached right after turn 1 again. Tokens of both must match; the ratio of the median TTFTs is
the figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from prima_rpc.app import ring
from tests.rings import collect, local_ring
from tools.default_model import ensure_default_store

WINDOWS = [10, 10, 10]


def system_prompt(tokens: int, seed: int) -> str:
    """About `tokens` tokens of house rules (a rule is about 30 tokens); seed makes each repeat's its own."""
    return f"House rules, set {seed}.\n" + "".join(
        f"Rule {i}: for device {i + seed * 100}, answer with its room, its owner and its last backup date.\n"
        for i in range(tokens // 30))


def turns(tokens: int, seed: int) -> tuple[str, str]:
    first = system_prompt(tokens, seed) + "User: Which rule covers device 7?\nAssistant:"
    return first, first + " Rule 7.\nUser: And who owns it?\nAssistant:"


def measure(head: str, tokens: int, repeats: int, max_tokens: int = 8) -> dict:
    cold, cached, prompt = [], [], 0
    for seed in range(repeats):
        first, second = turns(tokens, seed)
        ring.start(head, WINDOWS)  # a re-plan: no node holds a prefix
        cold_tokens, done = collect(head, second, max_tokens, raw=True, speculate="off")
        cold.append(done.ttft_ms)
        prompt = done.prompt_tokens
        ring.start(head, WINDOWS)
        collect(head, first, max_tokens, raw=True, speculate="off")  # turn 1 keeps its prompt's prefix
        warm_tokens, done = collect(head, second, max_tokens, raw=True, speculate="off")
        cached.append(done.ttft_ms)
        assert warm_tokens == cold_tokens, "the prefix cache changed the tokens"
    c, w = statistics.median(cold), statistics.median(cached)
    return {"prompt_tokens": prompt, "cold_ttft_ms": round(c, 1), "cached_ttft_ms": round(w, 1),
            "speedup": round(c / w, 2), "cold_all": cold, "cached_all": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    off = [["--prefix-disk", "0"]] * 3  # the memory cache alone: a re-plan leaves nothing (bench_prefix_restart)
    with tempfile.TemporaryDirectory() as logs, local_ring(ensure_default_store(), 3, Path(logs),
                                                           extra_args=off) as local:
        result = measure(local.addresses[0], args.system_tokens, args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"second turn of {result['prompt_tokens']} prompt tokens on a 3-node ring: TTFT cold "
              f"{result['cold_ttft_ms']} ms, cached {result['cached_ttft_ms']} ms ({result['speedup']}x lower)")


if __name__ == "__main__":
    main()
