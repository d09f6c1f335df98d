"""Speculative windows in flight round the ring (nodes/ring/inflight.py): single-request TPOT and tokens per
trip, side by side in one run, on a loopback ring whose every hop carries an added delay (--link-ms, 5 ms: a
bench-side proxy, tools/bench/delay_proxy.py, until the home testbed lands).

    python -m tools.bench.bench_inflight [--preset llama3-8b] [--layers 32] [--devices 4] [--tokens 32]
                                         [--rates 0.5,0.7,0.9] [--depths 1,2,4,8] [--draft-tokens 4]
                                         [--link-ms 5] [--sections mechanics,pair,scaling] [--json]

1. mechanics: an int4 synthetic store of --preset's shape (--layers of it), written once under
   $PRIMA_HOME/models. Rows: one device streaming its layers from disk (--mem-budget 1), the plain ring of
   --devices nodes, and speculation by a replay drafter (tools/bench/replay_drafter.py: the target's own greedy
   output, each token corrupted with probability 1 - rate) one window at a time (D = 1) and D windows in flight.
2. pair: SmolLM2 float32 as the target on the ring, its int4 store as the draft model (`--draft`) on the head,
   then on a relay (one node more, holding no layers) that drafts for the head, on chat, code and story prompts:
   off, ngram, and draft at each depth; the acceptance each drafter gets.
3. scaling: the mechanics model on 2, 3, ... --devices nodes, plain and with windows in flight (rate 0.7,
   the deepest --depths).
Greedy. Every row's tokens are checked against the plain ring's (`same`). TPOT is the head's (Finished.tpot_ms);
tokens per trip = tokens / trips (Finished.trips: the prompt's last trip and every window sent, cancelled ones
too).
"""

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from prima_rpc.client import Finished, PrimaClient, Token
from prima_rpc.spec.home import prima_home
from prima_rpc.spec.manifest import read_manifest
from tools.bench.delayed_ring import delayed_ring, even_windows
from tools.bench.markdown import table
from tools.default_model import default_store_dir, ensure_default_store
from tools.synth import synth

SYNTH_PROMPT = "Once upon a time, in a house with four computers,"
PAIR_PROMPTS = {
    "chat": "What should I cook for dinner tonight? Give me three ideas.",
    "code": "Write a Python function that checks whether a number is prime.",
    "story": "Write a short story about a robot who learns to paint.",
}


async def _generate(address: str, prompt: str, tokens: int, **kw) -> tuple[list[int], Finished]:
    out, done = [], None
    async with PrimaClient(address) as client:
        async for event in client.generate(prompt, max_tokens=tokens, **kw):
            if isinstance(event, Token):
                out.append(event.token_id)
            else:
                done = event
    return out, done


def generate(address: str, prompt: str, tokens: int, **kw) -> tuple[list[int], Finished]:
    return asyncio.run(_generate(address, prompt, tokens, **kw))


def row(section: str, name: str, out: list[int], done: Finished, truth: list[int], **extra) -> dict:
    r = {"section": section, "row": name, **extra, "tokens": len(out), "tpot_ms": round(done.tpot_ms, 2),
         "tokens_per_trip": round(len(out) / max(1, done.trips), 2), "trips": done.trips, "depth": done.depth,
         "drafted": done.drafted, "accepted": done.accepted, "same": out == truth}
    print(json.dumps(r), flush=True)
    return r


def synthetic_store(preset: str, layers: int) -> Path:
    path = prima_home() / "models" / f"synthetic-{preset}-int4-{layers}"
    if not (path / "manifest.json").is_file():
        print(f"writing a {layers}-layer int4 {preset} synthetic store to {path} ...", flush=True)
        synth(path, preset, layers=layers, dtype="int4", overwrite=True)
    return path


def write_replay(path: Path, rate: float, prompt_tokens: int, tokens: list[int]) -> None:
    path.write_text(json.dumps({"rate": rate, "seed": 1, "prompt_tokens": prompt_tokens, "tokens": tokens}))


def mechanics(args, store: Path, tmp: Path) -> list[dict]:
    rows, n_layers = [], read_manifest(store)[0].config.n_layers
    with delayed_ring(store, 1, tmp / "one", args.link_ms, [n_layers], [["--mem-budget", "1"]]) as head:
        generate(head, SYNTH_PROMPT, 4, speculate="off")  # warm-up
        truth, done = generate(head, SYNTH_PROMPT, args.tokens, speculate="off")
        rows.append(row("mechanics", "1 device, streaming", truth, done, truth, rate=None))
    replay = tmp / "replay.json"
    write_replay(replay, 0.0, done.prompt_tokens, truth)
    rows += on_ring(args, store, args.devices, tmp, replay, truth, done.prompt_tokens, args.rates, args.depths,
                    "mechanics")
    return rows


def on_ring(args, store: Path, n: int, tmp: Path, replay: Path, truth: list[int], prompt_tokens: int,
            rates: list[float], depths: list[int], section: str) -> list[dict]:
    rows, n_layers = [], read_manifest(store)[0].config.n_layers
    extra = [["--draft", str(store)]] + [[]] * (n - 1)
    with delayed_ring(store, n, tmp / f"ring{n}", args.link_ms, even_windows(n_layers, n), extra, replay) as head:
        generate(head, SYNTH_PROMPT, 4, speculate="off")  # warm-up
        out, done = generate(head, SYNTH_PROMPT, args.tokens, speculate="off")
        rows.append(row(section, f"plain ring, {n} devices", out, done, truth, devices=n, rate=None))
        for rate in rates:
            write_replay(replay, rate, prompt_tokens, truth)
            for d in depths:
                out, done = generate(head, SYNTH_PROMPT, args.tokens, speculate="draft", depth=d,
                                     draft_tokens=args.draft_tokens)
                rows.append(row(section, f"D={d}, {n} devices", out, done, truth, devices=n, rate=rate))
    return rows


def pair(args, tmp: Path) -> list[dict]:
    """The int4 draft on the head, then on a relay (one node more, no layers) that drafts for the head."""
    target, draft = ensure_default_store(dtype="float32"), default_store_dir("int4")
    n, rows = args.devices, []
    n_layers = read_manifest(target)[0].config.n_layers
    for where, windows, extra in [
            ("head", even_windows(n_layers, n), [["--draft", str(draft)]] + [[]] * (n - 1)),
            ("relay", even_windows(n_layers, n) + [0], [[]] * n + [["--draft", str(draft)]])]:
        with delayed_ring(target, len(windows), tmp / f"pair-{where}", args.link_ms, windows, extra) as head:
            generate(head, "Hi", 4, speculate="off")  # warm-up
            for name, prompt in PAIR_PROMPTS.items():
                truth, done = generate(head, prompt, args.tokens, speculate="off")
                rows.append(row("pair", f"off ({where} ring)", truth, done, truth, prompt=name))
                if where == "head":
                    out, done = generate(head, prompt, args.tokens, speculate="ngram", depth=1,
                                         draft_tokens=args.draft_tokens)
                    rows.append(row("pair", "ngram D=1", out, done, truth, prompt=name))
                for d in args.depths:
                    out, done = generate(head, prompt, args.tokens, speculate="draft", depth=d,
                                         draft_tokens=args.draft_tokens)
                    rows.append(row("pair", f"int4 draft on the {where}, D={d}", out, done, truth, prompt=name))
    return rows


def scaling(args, store: Path, tmp: Path, truth: list[int], prompt_tokens: int) -> list[dict]:
    rows, replay = [], tmp / "replay.json"
    for n in range(2, args.devices + 1):
        rows += on_ring(args, store, n, tmp, replay, truth, prompt_tokens, [0.7], [max(args.depths)], "scaling")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rates", default="0.5,0.7,0.9")
    ap.add_argument("--depths", default="1,2,4,8")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--link-ms", type=float, default=5.0)
    ap.add_argument("--sections", default="mechanics,pair,scaling")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.depths = [int(d) for d in args.depths.split(",")]
    sections = args.sections.split(",")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "mechanics" in sections or "scaling" in sections:
            store = synthetic_store(args.preset, args.layers)
            rows += mechanics(args, store, tmp)
        if "pair" in sections:
            rows += pair(args, tmp)
        if "scaling" in sections:
            rows += scaling(args, store, tmp, *_truth(tmp))
    if args.json:
        print(json.dumps({"preset": args.preset, "layers": args.layers, "devices": args.devices,
                          "tokens": args.tokens, "link_ms": args.link_ms, "draft_tokens": args.draft_tokens,
                          "rows": rows}))
        return
    print(table(["section", "row", "prompt", "rate", "TPOT ms", "tokens/trip", "accepted/drafted", "same"],
                ([r["section"], r["row"], r.get("prompt", ""), r.get("rate") or "", r["tpot_ms"],
                  r["tokens_per_trip"], f"{r['accepted']}/{r['drafted']}", r["same"]] for r in rows)))


def _truth(tmp: Path) -> tuple[list[int], int]:
    spec = json.loads((tmp / "replay.json").read_text())
    return spec["tokens"], spec["prompt_tokens"]


if __name__ == "__main__":
    main()
