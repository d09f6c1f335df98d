"""Predicted vs measured TPOT on real loopback rings: the cost model checked against the ring itself.

    python -m tools.bench.bench_prediction [--tokens 48] [--repeats 3] [--offload 0.6:200 0.95:1000]
        [--four 0.6:200] [--no-plain] [--nodes] [--json]

Starts 3 prima-node processes with SmolLM2, profiles them live (Control.Profile, one at a time), then
for each ring shape applies the windows, predicts TPOT with the solver's cost model for exactly those
windows, and measures TPOT (head-side, median of repeats) in the same run. Then the same with offload,
per FRACTION:MBPS: fresh nodes whose memory budgets hold FRACTION of their 10-layer share, each reading
from an emulated disk of MBPS ($PRIMA_DISK_MBPS; devices of a home have a disk each), profiled again
(the profile reports the budget and the emulated disk), shapes of 1, 2 and 5 rounds, each node given
the stream buffer the cost model picks for it. 0.6:200 is read-bound; 0.95:1000 makes a node's reads
in its turn about as long as its compute, where reading beside compute (not after it) shows. Each part ends
with Halda's own plan for those nodes, applied (removed nodes routed around) and measured. Last, 4 nodes
that must all offload (--four FRACTION:MBPS: budgets of FRACTION of 8 layers), shapes of 1, 2 and 3 rounds.
Each row also splits the error: the nodes' own per-token compute and stalls (predicted turn_ms, measured on
their one-token frames, as `prima-ctl status` shows them) and the rest (hops, the head's work). --nodes also
prints, per row, each node's compute, stalls, disk bytes and process CPU a token over the timed runs (prefill
included) and how busy the host's cores were.
"""

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from nodes.engine.diskio import DISK_MBPS_ENV
from nodes.engine.fused import head_bytes, kv_bytes, layer_bytes
from nodes.engine.prefetch import KV_RESERVE_TOKENS
from nodes.engine.store import LayerStore
from prima_rpc.app import ring
from prima_rpc.app.live_plan import plan_live, profile_ring
from prima_rpc.app.local_ring import launch
from prima_rpc.app.status_rows import status_row
from prima_rpc.client import Finished, PrimaClient
from prima_rpc.spec.profiles import devices_from_json
from solver.cost_model import Instance, evaluate
from solver.model_profile import ModelProfile
from solver.plan import build_plan
from solver.strategies import plan_to_json
from tools.default_model import ensure_default_store

PROMPT = "Write a short story about a robot who learns to paint."
SHAPES = [[10, 10, 10], [20, 5, 5], [7, 3, 5], [3, 1, 1], [15, 15, 0]]
OFFLOAD_SHAPES = [[10, 10, 10], [5, 5, 5], [2, 2, 2]]  # every node's share is 10 layers
FOUR_SHAPES = [[8, 8, 7, 7], [4, 4, 4, 3], [3, 3, 2, 2]]  # 4 nodes: shares of at most 8 layers, k = 1, 2, 3


async def tpot(head: str, tokens: int) -> float:
    """Plain decoding, as the plan predicts it (the head's default drafts with n-grams: a trip that verifies a
    draft computes several tokens and may yield one)."""
    async with PrimaClient(head) as client:
        async for event in client.generate(PROMPT, max_tokens=tokens, speculate="off"):
            if isinstance(event, Finished):
                return event.tpot_ms


def predict(devices, manifest: dict, windows: list[int]) -> dict:
    """The cost model's plan JSON for exactly these windows (with its stream buffers and terms)."""
    model = ModelProfile.from_json(manifest)
    inst = Instance(devices, model, n_ctx=KV_RESERVE_TOKENS)  # the KV room a node's budget keeps
    k = model.n_layers // sum(windows)
    in_ring, gpu = [True] * len(windows), [0] * len(windows)  # relays stay in the ring: they still cost a hop
    plan = build_plan(inst, k, windows, gpu, in_ring, 0.0, "fixed")
    return plan_to_json(plan, model.n_layers, evaluate(inst, k, windows, gpu, in_ring))


def apply(head: str, result: dict) -> None:
    """Start the ring on a plan JSON as `prima-ctl start --plan` does: removed nodes routed around, the plan's
    buffers, and its prediction kept by the nodes (status shows it beside what they measure)."""
    devs = result["devices"]
    ring.start(head, [d["window"] for d in devs], members=[d["role"] != "removed" for d in devs],
               buffers=[d["buffer_layers"] for d in devs], predicted=[d["turn_ms"] for d in devs],
               predicted_tpot_ms=result["predicted_tpot_ms"])


def turns(head: str, result: dict) -> tuple[float, float]:
    """(predicted, measured) ms a token of all nodes' compute and stalls, as `prima-ctl status` shows them: what
    the nodes time themselves, so a row's error splits into theirs and the rest (hops, the head's own work)."""
    rows = [status_row(*m) for m in ring.status(head)]
    return sum(d["turn_ms"] for d in result["devices"]), sum(r["measured_ms"] or 0.0 for r in rows)


def measured_tpot(head: str, tokens: int, repeats: int, predicted: list[float], pids: list[int] | None = None) -> float:
    """Median TPOT; with pids, also each node's compute, stalls (beside its `predicted` turns), reads and CPU."""
    asyncio.run(tpot(head, 4))  # warm-up
    before = per_node(head, pids) if pids else None
    wall, host = time.perf_counter(), psutil.cpu_times()
    out = statistics.median(asyncio.run(tpot(head, tokens)) for _ in range(repeats))
    if pids:
        wall, busy = time.perf_counter() - wall, psutil.cpu_times()
        idle = (busy.idle - host.idle) / psutil.cpu_count()
        n = repeats * tokens
        print("  per node and token (over the timed runs): " + "; ".join(
            f"compute {(a[0] - b[0]) / n * 1e3:.1f} stall {(a[1] - b[1]) / n * 1e3:.1f} ms (turns predicted {p:.1f}), "
            f"read {(a[2] - b[2]) / n / 1e6:.1f} MB, process CPU {(a[3] - b[3]) / n * 1e3:.1f} ms"
            for a, b, p in zip(per_node(head, pids), before, predicted)) +
            f"; the host's {psutil.cpu_count()} cores {1 - idle / wall:.0%} busy", flush=True)
    return out


def per_node(head: str, pids: list[int]) -> list[tuple[float, float, int, float]]:
    """(compute s, stall s, disk bytes read, process CPU s) of each node so far: what a token's time goes to."""
    rows = [status_row(*m) for m in ring.status(head)]
    cpu = [sum(psutil.Process(p).cpu_times()[:2]) for p in pids]
    return [(r["compute_s"], r["stall_s"], r["disk_read_bytes"], c) for r, c in zip(rows, cpu)]


def measure(store: Path, shapes: list[list[int]], tokens: int, repeats: int, logs: Path,
            extra: list[list[str]] | None = None, nodes: bool = False) -> list[tuple]:
    """(plan, windows, k, predicted ms, measured ms, nodes' turns predicted ms, measured ms) per shape, on one set
    of fresh nodes profiled live; last, the loop a user runs: `prima-ctl plan` (Halda on those profiles), applied
    as `start --plan` does (the nodes it removes routed around), then generate."""
    rows = []
    local = launch(store, len(shapes[0]), log_dir=logs, extra_args=extra, detach=False, timeout=120)
    try:
        head = local.addresses[0]
        ring.start(head, shapes[0])
        profiles, manifest = profile_ring(head, None, refresh=True)
        devices = devices_from_json(profiles)
        print("profiled (ms): " + "; ".join(
            f"{d.name} hop {d.frame_s * 1e3:.2f} + link {d.link_latency_s * 1e3:.2f}, visit {d.visit_s * 1e3:.2f}, "
            f"token {d.token_s * 1e3:.2f}, output {d.output_s * 1e3:.2f}, disk {d.disk_seq_read / 1e6:.0f} MB/s, "
            f"reader {d.read_cpu_s * 1e9:.2f} ns/B, loss {d.read_loss_s * 1e9:.2f} ns/B, "
            f"streamed layer +{d.stream_layer_s * 1e3:.2f}"
            for d in devices), flush=True)
        plans = [("fixed", predict(devices, manifest, w)) for w in shapes]
        plans.append(("halda", plan_live(head, None, "halda")))  # the profiles cached above
        for name, result in plans:
            apply(head, result)
            measured = measured_tpot(head, tokens, repeats, [d["turn_ms"] for d in result["devices"]],
                                     [p.pid for p in local.processes] if nodes else None)
            windows = [d["window"] for d in result["devices"]]
            rows.append((name, windows, result["k"], result["predicted_tpot_ms"], measured, *turns(head, result)))
            terms = ", ".join(f"{t} {v:.1f}" for t, v in result["terms_ms"].items())
            print(f"{name} {windows}: predicted {result['predicted_tpot_ms']:.1f} ms ({terms}), "
                  f"measured {measured:.1f} ms", flush=True)
    finally:
        local.stop()
    return rows


def budgets(store: Path, fraction: float, share: int = 10, nodes: int = 3) -> list[int]:
    """Per node: head units (node 0) + KV reserve + `fraction` of its share of layer bytes."""
    cfg, dtype = LayerStore(store).config, torch.float32
    fixed = [kv_bytes(cfg, dtype, share, KV_RESERVE_TOKENS) + (head_bytes(cfg, dtype) if i == 0 else 0)
             for i in range(nodes)]
    return [f + int(fraction * share * layer_bytes(cfg, dtype)) for f in fixed]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--offload", nargs="*", default=["0.6:200", "0.95:1000"],
                   help="FRACTION:MBPS per offload part: budget / share of layer bytes, each node's emulated disk")
    p.add_argument("--offload-tokens", type=int, default=16)
    p.add_argument("--four", nargs="*", default=["0.6:200"],
                   help="FRACTION:MBPS per part on 4 nodes that must all offload (budget / 8 layers)")
    p.add_argument("--no-plain", action="store_true", help="only the offload parts")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.add_argument("--nodes", action="store_true",
                   help="print each node's compute, stalls, reads and process CPU a token, and the host's CPU use")
    args = p.parse_args()
    store = ensure_default_store()
    with tempfile.TemporaryDirectory() as logs:
        rows = [] if args.no_plain else [("-", *r) for r in measure(store, SHAPES, args.tokens, args.repeats,
                                                                     Path(logs), nodes=args.nodes)]
        for part in args.offload:
            fraction, mbps = (float(x) for x in part.split(":"))
            os.environ[DISK_MBPS_ENV] = str(mbps)
            try:
                extra = [["--mem-budget", str(b)] for b in budgets(store, fraction)]
                rows += [(f"{fraction:.0%}, {mbps:g} MB/s", *r) for r in
                         measure(store, OFFLOAD_SHAPES, args.offload_tokens, args.repeats, Path(logs), extra,
                                 args.nodes)]
            finally:
                os.environ.pop(DISK_MBPS_ENV, None)
        for part in args.four:
            fraction, mbps = (float(x) for x in part.split(":"))
            os.environ[DISK_MBPS_ENV] = str(mbps)
            try:
                extra = [["--mem-budget", str(b)] for b in budgets(store, fraction, 8, 4)]
                rows += [(f"4 nodes, {fraction:.0%} of 8, {mbps:g} MB/s", *r) for r in
                         measure(store, FOUR_SHAPES, args.offload_tokens, args.repeats, Path(logs), extra,
                                 args.nodes)]
            finally:
                os.environ.pop(DISK_MBPS_ENV, None)
    print(f"SmolLM2-135M fp32, 3 nodes (4 where said) on loopback, {args.tokens} tokens "
          f"({args.offload_tokens} with offload), median of {args.repeats}")
    print("| budget/share, disk | plan | windows | k | predicted ms | measured ms | error | nodes' turns pred / meas "
          "| rest pred / meas |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for budget, plan, windows, k, pred, meas, turn_pred, turn_meas in rows:
        print(f"| {budget} | {plan} | {', '.join(map(str, windows))} | {k} | {pred:.1f} | {meas:.1f} | "
              f"{(pred - meas) / meas:+.1%} | {turn_pred:.1f} / {turn_meas:.1f} | "
              f"{pred - turn_pred:.1f} / {meas - turn_meas:.1f} |")
    if args.json:
        keys = ("budget", "plan", "windows", "k", "predicted_ms", "measured_ms", "turns_predicted_ms",
                "turns_measured_ms")
        print(json.dumps([dict(zip(keys, r)) for r in rows]))


if __name__ == "__main__":
    main()
