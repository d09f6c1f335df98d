"""Speculative decoding (prompt lookup): TPOT and ring trips per token with and without, one run.

    python -m tools.bench.bench_speculate [--tokens 48] [--draft-tokens 4] [--no-ring]

Rows: the default model in one process, and on a 3-node loopback ring whose nodes stream layers from disk
(--mem-budget 1: each is raised to its minimum); for a prompt that repeats its context (prompt lookup's best
case) and an ordinary chat prompt. Greedy. Trips per token = (tokens - accepted) / tokens: every trip
yields its accepted drafts plus one token of the target's own. TPOT is the mean time per token after the
first (the head's Finished event for rings, the same clock in process).
"""

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from nodes.generation import GenerateParams
from nodes.reference import ReferenceModel
from nodes.speculate import SpeculateParams, Speculator
from prima_rpc.app import ring
from prima_rpc.app.local_ring import launch
from prima_rpc.client import Finished, PrimaClient, Token
from tools.default_model import ensure_default_store

PROMPTS = {
    "repeating": ("Copy this paragraph exactly, twice: The ring carries one activation from device to device; each "
                  "device runs its layers and passes the result on, and the head samples the next token."),
    "chat": "Write a short story about a robot who learns to paint.",
}


def row(setting: str, tokens: int, accepted: int, drafted: int, tpot_ms: float) -> dict:
    return {"setting": setting, "tokens": tokens, "drafted": drafted, "accepted": accepted,
            "trips_per_token": round((tokens - accepted) / tokens, 3), "tpot_ms": round(tpot_ms, 2)}


def in_process(store: Path, prompt: str, tokens: int, speculate: SpeculateParams) -> dict:
    model = ReferenceModel(store)
    spec = Speculator(speculate)
    stamps = []
    for _ in model.generate(prompt, GenerateParams(max_tokens=tokens, speculate=speculate), spec=spec):
        stamps.append(time.perf_counter())
    return row(speculate.mode, len(stamps), spec.accepted, spec.drafted,
               (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)


async def on_ring(address: str, prompt: str, tokens: int, speculate: SpeculateParams) -> dict:
    n, done = 0, None
    async with PrimaClient(address) as client:
        async for event in client.generate(prompt, max_tokens=tokens, speculate=speculate.mode,
                                           draft_tokens=speculate.draft_tokens):
            if isinstance(event, Token):
                n += 1
            elif isinstance(event, Finished):
                done = event
    return row(speculate.mode, n, done.accepted, done.drafted, done.tpot_ms)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--no-ring", action="store_true")
    args = ap.parse_args()
    store = ensure_default_store()
    settings = [SpeculateParams("off"), SpeculateParams("ngram", args.draft_tokens)]
    results = []
    for name, prompt in PROMPTS.items():
        in_process(store, prompt, 4, settings[0])  # warm-up
        for s in settings:
            results.append({"where": "1 process", "prompt": name, **in_process(store, prompt, args.tokens, s)})
            print(json.dumps(results[-1]), flush=True)
    if not args.no_ring:
        with tempfile.TemporaryDirectory() as logs:
            local = launch(store, 3, log_dir=Path(logs), detach=False, extra_args=[["--mem-budget", "1"]] * 3)
            try:
                ring.start(local.addresses[0], [10, 10, 10])
                for name, prompt in PROMPTS.items():
                    asyncio.run(on_ring(local.addresses[0], prompt, 4, settings[0]))  # warm-up
                    for s in settings:
                        r = asyncio.run(on_ring(local.addresses[0], prompt, args.tokens, s))
                        results.append({"where": "3-node ring, streaming", "prompt": name, **r})
                        print(json.dumps(results[-1]), flush=True)
            finally:
                local.stop()
    print("\n| where | prompt | setting | trips/token | TPOT ms | accepted/drafted |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['where']} | {r['prompt']} | {r['setting']} | {r['trips_per_token']} | {r['tpot_ms']} | "
              f"{r['accepted']}/{r['drafted']} |")


if __name__ == "__main__":
    main()
