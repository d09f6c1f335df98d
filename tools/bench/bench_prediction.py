"""Predicted vs measured TPOT on real loopback rings: the cost model checked against the ring itself.

    python -m tools.bench.bench_prediction [--tokens 48] [--repeats 3] [--offload 0.6:200 0.95:1000]

Starts 3 prima-node processes with SmolLM2, profiles them live (Control.Profile, one at a time), then
for each ring shape applies the windows, predicts TPOT with the solver's cost model for exactly those
windows, and measures TPOT (head-side, median of repeats) in the same run. Then the same with offload,
per FRACTION:MBPS: fresh nodes whose memory budgets hold FRACTION of their 10-layer share, each reading
from an emulated disk of MBPS ($PRIMA_DISK_MBPS; devices of a home have a disk each), profiled again
(the profile reports the budget and the emulated disk), shapes of 1, 2 and 5 rounds, each node given
the stream buffer the cost model picks for it. 0.6:200 is read-bound; 0.95:1000 makes a node's reads
in its turn about as long as its compute, where reading beside compute (not after it) shows. Each part ends
with Halda's own plan for those nodes, applied (removed nodes routed around) and measured.
"""

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

import torch

from nodes.diskio import DISK_MBPS_ENV
from nodes.fused import head_bytes, kv_bytes, layer_bytes
from nodes.prefetch import KV_RESERVE_TOKENS
from nodes.store import LayerStore
from prima_rpc.app import ring
from prima_rpc.app.live_plan import plan_live, profile_ring
from prima_rpc.app.local_ring import launch
from prima_rpc.client import Finished, PrimaClient
from solver.cost_model import Instance
from solver.model_profile import ModelProfile
from solver.plan import RingPlan, build_plan
from solver.profiles import devices_from_json
from tools.default_model import ensure_default_store

PROMPT = "Write a short story about a robot who learns to paint."
SHAPES = [[10, 10, 10], [20, 5, 5], [7, 3, 5], [3, 1, 1], [15, 15, 0]]
OFFLOAD_SHAPES = [[10, 10, 10], [5, 5, 5], [2, 2, 2]]  # every node's share is 10 layers


async def tpot(head: str, tokens: int) -> float:
    async with PrimaClient(head) as client:
        async for event in client.generate(PROMPT, max_tokens=tokens):
            if isinstance(event, Finished):
                return event.tpot_ms


def predict(devices, manifest: dict, windows: list[int]) -> RingPlan:
    """The cost model's plan for exactly these windows (with its stream buffers)."""
    model = ModelProfile.from_json(manifest)
    inst = Instance(devices, model, n_ctx=KV_RESERVE_TOKENS)  # the KV room a node's budget keeps
    k = model.n_layers // sum(windows)
    in_ring = [True] * len(windows)  # relays stay in the ring: they still cost a hop
    return build_plan(inst, k, windows, [0] * len(windows), in_ring, 0.0, "fixed")


def measured_tpot(head: str, tokens: int, repeats: int) -> float:
    asyncio.run(tpot(head, 4))  # warm-up
    return statistics.median(asyncio.run(tpot(head, tokens)) for _ in range(repeats))


def measure(store: Path, shapes: list[list[int]], tokens: int, repeats: int, logs: Path,
            extra: list[list[str]] | None = None) -> list[tuple[str, list[int], int, float, float]]:
    """(plan, windows, k, predicted ms, measured ms) per shape, on one set of fresh nodes profiled live; last,
    the loop a user runs: `prima-ctl plan` (Halda on those profiles), applied as `start --plan` does (the nodes
    it removes routed around), then generate."""
    rows = []
    local = launch(store, 3, log_dir=logs, extra_args=extra, detach=False, timeout=120)
    try:
        ring.start(local.addresses[0], shapes[0])
        profiles, manifest = profile_ring(local.addresses[0], None, refresh=True)
        devices = devices_from_json(profiles)
        print("profiled (ms): " + "; ".join(f"{d.name} hop {d.frame_s * 1e3:.2f} + link {d.link_latency_s * 1e3:.2f}, "
                                           f"token {d.token_s * 1e3:.2f}, output {d.output_s * 1e3:.2f}"
                                           for d in devices), flush=True)
        for windows in shapes:
            plan = predict(devices, manifest, windows)
            ring.start(local.addresses[0], windows, buffers=[d.buffer_layers for d in plan.devices])
            measured = measured_tpot(local.addresses[0], tokens, repeats)
            rows.append(("fixed", windows, plan.k, plan.predicted_tpot_s * 1e3, measured))
            print(f"{windows}: predicted {plan.predicted_tpot_s * 1e3:.1f} ms, measured {measured:.1f} ms", flush=True)
        result = plan_live(local.addresses[0], None, "halda")  # the profiles cached above
        devs = result["devices"]
        ring.start(local.addresses[0], [d["window"] for d in devs], members=[d["role"] != "removed" for d in devs],
                   buffers=[d["buffer_layers"] for d in devs])
        measured = measured_tpot(local.addresses[0], tokens, repeats)
        rows.append(("halda", [d["window"] for d in devs], result["k"], result["predicted_tpot_ms"], measured))
        print(f"halda {[d['window'] for d in devs]}: predicted {result['predicted_tpot_ms']:.1f} ms "
              f"({result['terms_ms']}), measured {measured:.1f} ms", flush=True)
    finally:
        local.stop()
    return rows


def budgets(store: Path, fraction: float, share: int = 10) -> list[int]:
    """Per node: head units (node 0) + KV reserve + `fraction` of its share of layer bytes."""
    cfg, dtype = LayerStore(store).config, torch.float32
    fixed = [kv_bytes(cfg, dtype, share, KV_RESERVE_TOKENS) + (head_bytes(cfg, dtype) if i == 0 else 0)
             for i in range(3)]
    return [f + int(fraction * share * layer_bytes(cfg, dtype)) for f in fixed]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--offload", nargs="*", default=["0.6:200", "0.95:1000"],
                   help="FRACTION:MBPS per offload part: budget / share of layer bytes, each node's emulated disk")
    p.add_argument("--offload-tokens", type=int, default=16)
    p.add_argument("--no-plain", action="store_true", help="only the offload parts")
    args = p.parse_args()
    store = ensure_default_store()
    with tempfile.TemporaryDirectory() as logs:
        rows = [] if args.no_plain else [("-", *r) for r in measure(store, SHAPES, args.tokens, args.repeats,
                                                                     Path(logs))]
        for part in args.offload:
            fraction, mbps = (float(x) for x in part.split(":"))
            os.environ[DISK_MBPS_ENV] = str(mbps)
            try:
                extra = [["--mem-budget", str(b)] for b in budgets(store, fraction)]
                rows += [(f"{fraction:.0%}, {mbps:g} MB/s", *r) for r in
                         measure(store, OFFLOAD_SHAPES, args.offload_tokens, args.repeats, Path(logs), extra)]
            finally:
                os.environ.pop(DISK_MBPS_ENV, None)
    print(f"SmolLM2-135M fp32, 3 nodes on loopback, {args.tokens} tokens ({args.offload_tokens} with offload), "
          f"median of {args.repeats}")
    print("| budget/share, disk | plan | windows | k | predicted ms | measured ms | error |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for budget, plan, windows, k, pred, meas in rows:
        print(f"| {budget} | {plan} | {', '.join(map(str, windows))} | {k} | {pred:.1f} | {meas:.1f} | "
              f"{(pred - meas) / meas:+.1%} |")


if __name__ == "__main__":
    main()
