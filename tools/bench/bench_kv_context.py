"""A long context that fits only with int8 KV: the plan chooses it, the ring runs it, and its TPOT is measured
beside the plan's prediction (issue 50).

    python -m tools.bench.bench_kv_context [--ctx 32768] [--nodes 2] [--budget-mib 48] [--tokens 8] [--json]

A synthetic store of the `long-32k` preset (4 llama layers of hidden 256, 2 KV heads of 64, a 32k context; float32:
4 KiB of float KV a position, 128 MiB at 32k) on a loopback ring of --nodes prima-node processes at --kv-dtype
auto, each under --mem-budget --budget-mib (its layers and its share of the float KV do not fit, of int8 KV they do).
The ring is profiled live and planned for --ctx (`prima-ctl plan --ctx`): Halda prices each node's KV at that
context and takes int8 for it. First the ring is assigned the plan's windows with float KV forced: a prompt of
--ctx - --tokens positions is refused before prefill, with the numbers. Then the plan is applied as `prima-ctl
start` applies it (its KV dtypes and context), the same prompt runs, and its TPOT (the head's decode steps at the
context's end) is set beside the plan's predicted TPOT.

The cost model prices a token's weight reads, compute and hops, not attention over the context; at 32k positions
of a small body attention is much of a token, so the gap this prints is that term (docs/kv-cache.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from prima_rpc.app import ring
from prima_rpc.app.live_plan import plan_live
from prima_rpc.client import PrimaError
from tests.rings import collect, local_ring
from tools.synth import synth

PRESET = "long-32k"


def long_prompt(positions: int) -> str:
    """About `positions` byte tokens of plain text (the synthetic tokenizer is one token a byte)."""
    line = "the quick brown fox jumps over the lazy dog, "
    return (line * (positions // len(line) + 1))[:positions]


def measure(head: str, ctx: int, tokens: int) -> dict:
    plan = plan_live(head, None, ctx=ctx)
    if "infeasible" in plan:
        return {"infeasible": plan["infeasible"]}
    windows = [int(d["window"]) for d in plan["devices"]]
    prompt = long_prompt(ctx - tokens - 8)  # room for the chat-free prompt's BOS and the tokens decoded
    ring.start(head, windows, kv_dtypes=["float"] * len(windows), ctx=plan["ctx"])
    try:
        collect(head, prompt, tokens, raw=True, speculate="off")
        refused = ""
    except PrimaError as exc:
        refused = str(exc)[:300]
    ring.start(head, windows, kv_dtypes=[d["kv_dtype"] for d in plan["devices"]], ctx=plan["ctx"])
    rows = [(a, info) for a, info in ring.walk(head)]
    seen = {"ctx": ctx, "windows": windows, "kv_dtypes": [info.kv_dtype for _, info in rows],
            "kv_bytes_per_token": [info.kv_bytes_per_token for _, info in rows],
            "kv_positions": [info.kv_positions for _, info in rows], "float_refused": refused}
    try:
        out, done = collect(head, prompt, tokens, raw=True, speculate="off")
    except PrimaError as exc:
        return seen | {"planned_refused": str(exc)[:300], "predicted_tpot_ms": plan["predicted_tpot_ms"]}
    return seen | {"prompt_tokens": done.prompt_tokens, "tokens": len(out), "ttft_ms": done.ttft_ms,
            "measured_tpot_ms": done.tpot_ms,
            "predicted_tpot_ms": plan["predicted_tpot_ms"],
            "error": done.tpot_ms / plan["predicted_tpot_ms"] - 1 if plan["predicted_tpot_ms"] else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--budget-mib", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = synth(Path(tmp) / PRESET, PRESET, seed=7)
        extra = [["--mem-budget", f"{args.budget_mib}MiB"]] * args.nodes
        with local_ring(store, args.nodes, Path(tmp) / "logs", extra_args=extra) as local:
            result = measure(local.addresses[0], args.ctx, args.tokens)
    if args.json:
        print(json.dumps(result))
        return
    if "infeasible" in result or "planned_refused" in result:
        print(json.dumps(result))
        return
    print(f"{result['ctx']}-token context on {args.nodes} nodes of {args.budget_mib} MiB: float KV refused "
          f"({result['float_refused'] or 'not refused'}); the plan's KV {result['kv_dtypes']} "
          f"({result['kv_bytes_per_token']} bytes a position), windows {result['windows']}: prompt of "
          f"{result['prompt_tokens']} tokens, TTFT {result['ttft_ms']:.0f} ms, TPOT {result['measured_tpot_ms']:.1f} "
          f"ms measured vs {result['predicted_tpot_ms']:.1f} ms predicted ({result['error']:+.0%})")


if __name__ == "__main__":
    main()
