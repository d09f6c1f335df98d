"""Batching: aggregate tokens/s and per-request TPOT of M concurrent requests on a 3-node loopback ring.

    python -m tools.bench.bench_batch [--tokens 32] [--ms 1,2,4,8] [--budget 0.6] [--disk-mbps 1000] [--json]

Two rings of real prima-node processes on 127.0.0.1 with the default model (SmolLM2-135M-Instruct, float32
store, `prima-ctl import --default`), windows [10, 10, 10]: resident (no budget), and offloading (every node
with a memory budget of the head's units, the KV reserve and BUDGET (default 0.6) of its 10 layers' bytes, so
4 of them stream from disk every token, through the stream buffers the cost model chooses (applied as
`prima-ctl start --plan` does), each node's disk emulated at MBPS ($PRIMA_DISK_MBPS: a device's own disk, which its
profile measures; the page cache would otherwise serve this small store at memory speed, which no profile of a
real disk predicts). For each M the M requests start at once, each asking for the same number of greedy tokens
(story prompts that run past it; speculation off, so every step is a plain decode step); rows of the two rings
are interleaved (M by M) so both see the same machine. Figures: aggregate tokens/s (all tokens / wall time)
and decode tokens/s (the requests' 1 / TPOT added up: what the model predicts), mean per-request TPOT (the
head's Finished.tpot_ms), mean batch per node over the run (batched_frames / batches, head first), the ratio
to M = 1 of the same ring, and the plan's prediction beside them: aggregate tokens/s and per-request TPOT from
solver/throughput.py (heteropipe's makespans over the live nodes' profiled batch curves, the nodes sharing
this host's CPU), for the batching the ring runs (all M requests in one batch, one batch in flight: the nodes'
defaults), and its error against the measured decode tokens/s.
"""

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from nodes.engine.diskio import DISK_MBPS_ENV
from prima_rpc.app import ring
from prima_rpc.app.local_ring import launch
from prima_rpc.client import Finished, PrimaClient, Token
from tools.bench.batch_prediction import predict_live
from tools.bench.bench_prediction import budgets
from tools.default_model import ensure_default_store

WINDOWS = [10, 10, 10]
TOPICS = ["a robot who learns to paint", "a lighthouse keeper and a storm", "a cat who runs a bakery",
          "two rivals on a mountain", "a city built on a whale", "a clock that runs backwards",
          "a gardener on Mars", "a dragon who collects stamps"]


def predict(head: str, m: int) -> dict:
    """The throughput model's row for M requests on the ring at `head` as it runs them: one batch of M."""
    return predict_live(head, None, [m], max_batch=m, micro_batches=1)[0]


async def one(head: str, topic: str, tokens: int) -> tuple[int, Finished | None]:
    n, done = 0, None
    async with PrimaClient(head) as client:
        async for event in client.generate(f"Write a long story about {topic}.", max_tokens=tokens, speculate="off"):
            if isinstance(event, Token):
                n += 1
            else:
                done = event
    return n, done


async def concurrent(head: str, m: int, tokens: int) -> tuple[float, list]:
    start = time.perf_counter()
    results = await asyncio.gather(*(one(head, TOPICS[i % len(TOPICS)], tokens) for i in range(m)))
    return time.perf_counter() - start, results


def run(head: str, m: int, tokens: int) -> dict:
    before = [info.stats for _, info in ring.walk(head)]
    wall, results = asyncio.run(concurrent(head, m, tokens))
    after = [info.stats for _, info in ring.walk(head)]
    total = sum(n for n, _ in results)
    batch = [(a.batched_frames - b.batched_frames) / max(a.batches - b.batches, 1) for a, b in zip(after, before)]
    return {"m": m, "tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "tpot_ms": statistics.mean(d.tpot_ms for _, d in results), "mean_batch": batch,
            # the M requests' decode rates added up (they run side by side from start to end): what the model
            # predicts, without the prompts' prefill and the ramp at both ends that the wall clock also holds
            "decode_tps": sum(1e3 / d.tpot_ms for _, d in results),
            "disk_read_bytes": sum(a.disk_read_bytes - b.disk_read_bytes for a, b in zip(after, before))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--ms", default="1,2,4,8", help="concurrent requests, comma-separated")
    p.add_argument("--budget", type=float, default=0.6, help="offloading nodes' budget: this share of their layers")
    p.add_argument("--disk-mbps", type=float, default=1000.0, help="the offloading nodes' emulated disk, MB/s")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    store = ensure_default_store()
    modes = {"resident": [[]] * 3, "offloading": [["--mem-budget", str(b)] for b in budgets(store, args.budget)]}
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        rings = {}
        for mode, extra in modes.items():  # the offloading ring's nodes read through an emulated disk
            os.environ.pop(DISK_MBPS_ENV, None) if mode == "resident" else os.environ.update(
                {DISK_MBPS_ENV: str(args.disk_mbps)})
            rings[mode] = launch(store, 3, log_dir=Path(logs) / mode, extra_args=extra, detach=False)
        os.environ.pop(DISK_MBPS_ENV, None)
        try:
            predicted = {}
            for mode, local in rings.items():
                head = local.addresses[0]
                ring.start(head, WINDOWS)
                for m in ms:  # profiled once per node (cached), before the rows load the machine
                    predicted[mode, m] = predict(head, m)
                ring.start(head, WINDOWS, buffers=predicted[mode, ms[0]]["buffers"])  # the buffers it priced
                asyncio.run(concurrent(head, 2, 4))  # warm-up
            for m in ms:
                for mode, local in rings.items():
                    row = {"mode": mode, **run(local.addresses[0], m, args.tokens)}
                    p = predicted[mode, m]
                    row["predicted"] = p["aggregate_tps"]
                    row["predicted_tpot_ms"] = p["tpot_ms_per_request"]
                    row["bottleneck"] = p["bottleneck"]
                    rows.append(row)
        finally:
            for local in rings.values():
                local.stop()
    for row in rows:
        base = next(r for r in rows if r["mode"] == row["mode"] and r["m"] == ms[0])
        row["ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["error"] = row["predicted"] / row["decode_tps"] - 1
    if args.json:
        print(json.dumps({"windows": WINDOWS, "tokens": args.tokens, "budget": args.budget,
                          "disk_mbps": args.disk_mbps, "rows": rows}, indent=1))
        return
    print(f"SmolLM2-135M-Instruct float32, 3-node loopback ring {WINDOWS}, {args.tokens} greedy tokens per request; "
          f"offloading: budgets of {args.budget:.0%} of a node's layers, disks emulated at {args.disk_mbps:g} MB/s")
    print(f"{'ring':11} {'M':>2} {'tok/s':>7} {'x M=1':>6} {'decode tok/s':>12} {'predicted':>9} {'error':>6}"
          f" {'TPOT ms':>8} {'pred ms':>8}"
          f" {'mean batch per node':>20} {'disk MiB':>9}  bottleneck (predicted)")
    for r in rows:
        batch = " ".join(f"{b:.1f}" for b in r["mean_batch"])
        print(f"{r['mode']:11} {r['m']:2d} {r['tokens_per_s']:7.1f} {r['ratio']:6.2f} {r['decode_tps']:12.1f}"
              f" {r['predicted']:9.1f}"
              f" {r['error']:+6.0%} {r['tpot_ms']:8.1f} {r['predicted_tpot_ms']:8.1f} {batch:>20}"
              f" {r['disk_read_bytes'] / 2**20:9.0f}  {r['bottleneck']}")


if __name__ == "__main__":
    main()
