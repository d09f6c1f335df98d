"""Speculative decoding: TPOT and ring trips per token with and without, side by side in one run.

    python -m tools.bench.bench_speculate [--tokens 48] [--draft-tokens 4] [--draft-layers 4] [--repeats 3]
                                          [--dtype int4] [--no-ring] [--json]

Where: the default model (SmolLM2, int4 unless --dtype) in one process, and on a 3-node loopback ring whose nodes
stream layers from disk (--mem-budget 1: each is raised to its minimum). Prompts: one that repeats its context
(prompt lookup's best case), an ordinary chat prompt, and an ordinary one on which prompt lookup drafts now and
then (most drafts rejected). Settings: off, ngram (prompt lookup) and draft (a truncated copy of the target, its
first --draft-layers layers, made by tools/truncate_store.py; on the ring the head runs it, `prima-node --draft`).
Greedy. The settings run interleaved (each in turn first), --repeats times each; a row reports the median TPOT
(--json: every run's too). Trips per token = (tokens - accepted) / tokens: every trip yields its accepted drafts
plus one token of the target's own. TPOT is the mean time per token after the first (the head's Finished event on
rings, the same clock in process). Ratios are against `off` on the same prompt and place.
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from nodes.generation.draft import DraftModel
from nodes.generation.reference import ReferenceModel
from nodes.generation.speculate import SpeculateParams, Speculator
from nodes.generation.state import GenerateParams
from prima_rpc.app import ring
from prima_rpc.app.local_ring import launch
from prima_rpc.client import Finished, PrimaClient, Token
from tools.bench.markdown import table
from tools.default_model import DEFAULT_DTYPE, ensure_default_store
from tools.truncate_store import truncate_store

PROMPTS = {
    "repeating": ("Copy this paragraph exactly, twice: The ring carries one activation from device to device; each "
                  "device runs its layers and passes the result on, and the head samples the next token."),
    "chat": "Write a short story about a robot who learns to paint.",
    "code": "Write a Python function that reverses a string, then explain it.",  # ordinary, but drafts some
}
MODES = ("off", "ngram", "draft")


def run_in_process(model: ReferenceModel, draft: ReferenceModel, prompt: str, tokens: int,
                   speculate: SpeculateParams) -> tuple[int, int, int, float]:
    """(tokens, drafted, accepted, TPOT ms) of one greedy generation."""
    spec = Speculator(speculate, DraftModel(draft) if speculate.mode == "draft" else None)
    stamps = [time.perf_counter() for _ in model.generate(prompt, GenerateParams(max_tokens=tokens,
                                                                                 speculate=speculate), spec=spec)]
    return len(stamps), spec.drafted, spec.accepted, (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


async def run_on_ring(address: str, prompt: str, tokens: int,
                      speculate: SpeculateParams) -> tuple[int, int, int, float]:
    n, done = 0, None
    async with PrimaClient(address) as client:
        async for event in client.generate(prompt, max_tokens=tokens, speculate=speculate.mode,
                                           draft_tokens=speculate.draft_tokens):
            if isinstance(event, Token):
                n += 1
            elif isinstance(event, Finished):
                done = event
    return n, done.drafted, done.accepted, done.tpot_ms


def measure(where: str, generate, args) -> list[dict]:
    """Rows of one place: for each prompt, every setting run --repeats times, interleaved."""
    rows = []
    for name, prompt in PROMPTS.items():
        generate(prompt, 4, SpeculateParams("off"))  # warm-up
        runs = {mode: [] for mode in MODES}
        for r in range(args.repeats):
            for mode in MODES[r % 3:] + MODES[:r % 3]:  # each setting runs first, second and third in turn
                runs[mode].append(generate(prompt, args.tokens, SpeculateParams(mode, args.draft_tokens)))
        base = None
        for mode in MODES:
            n, drafted, accepted, _ = runs[mode][0]  # greedy: every repeat drafts and accepts the same
            tpot = statistics.median(r[3] for r in runs[mode])
            trips = (n - accepted) / n
            base = base or (trips, tpot)
            rows.append({"where": where, "prompt": name, "setting": mode, "tokens": n, "drafted": drafted,
                         "accepted": accepted, "trips_per_token": round(trips, 3), "tpot_ms": round(tpot, 2),
                         "tpot_ms_runs": [round(r[3], 2) for r in runs[mode]],
                         "fewer_trips_x": round(base[0] / trips, 2), "tpot_speedup_x": round(base[1] / tpot, 2)})
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated draft copy")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE, help="the default model's store: float32 or int4")
    ap.add_argument("--no-ring", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    store = ensure_default_store(dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        draft_store = Path(tmp) / "draft"
        truncate_store(store, draft_store, args.draft_layers)
        model, draft = ReferenceModel(store), ReferenceModel(draft_store)
        rows = measure("1 process", lambda p, t, s: run_in_process(model, draft, p, t, s), args)
        if not args.no_ring:
            extra = [["--mem-budget", "1", "--draft", str(draft_store)]] + [["--mem-budget", "1"]] * 2
            local = launch(store, 3, log_dir=Path(tmp) / "logs", detach=False, extra_args=extra)
            try:
                ring.start(local.addresses[0], [10, 10, 10])
                rows += measure("3-node ring, streaming",
                                lambda p, t, s: asyncio.run(run_on_ring(local.addresses[0], p, t, s)), args)
            finally:
                local.stop()
    if args.json:
        print(json.dumps({"model": store.name, "tokens": args.tokens, "draft_tokens": args.draft_tokens,
                          "draft_layers": args.draft_layers, "repeats": args.repeats, "rows": rows}))
        return
    print(f"\n{store.name}, {args.tokens} tokens, greedy, --draft-tokens {args.draft_tokens}, "
          f"draft = first {args.draft_layers} layers; ratios against off")
    print(table(["where", "prompt", "setting", "trips/token", "fewer trips", "TPOT ms", "TPOT speed-up",
                 "accepted/drafted"],
                ([r["where"], r["prompt"], r["setting"], r["trips_per_token"], f"{r['fewer_trips_x']}x", r["tpot_ms"],
                  f"{r['tpot_speedup_x']}x", f"{r['accepted']}/{r['drafted']}"] for r in rows)))


if __name__ == "__main__":
    main()
