"""The predicted column of the many-users benchmark (issue 16): throughput of a live ring for M requests at once.

    python -m tools.bench.batch_prediction [--concurrency 1 2 4 8] [--dtype float32] [--json]

tools/bench/bench_batch.py measures aggregate tokens/s and per-request TPOT on a ring; `predict_live` gives
the prediction beside it for the windows the ring holds and the batching it runs (max_batch, micro_batches as
its Assign set them; None: the plan's best for M). Run alone, this starts a 3-node loopback ring of the
default model, resident (10, 10, 10) and offloading (each node's budget holds 60 % of its share, disks
emulated at 200 MB/s as in bench_prediction), profiles it as `prima-ctl plan` does and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from nodes.engine.diskio import DISK_MBPS_ENV
from nodes.engine.prefetch import KV_RESERVE_TOKENS
from prima_rpc.app import ring
from prima_rpc.app.applied_plan import assignment
from prima_rpc.app.live_plan import profile_ring
from prima_rpc.spec.profiles import DeviceProfile, devices_from_json
from solver.cost_model import Instance
from solver.model_profile import ModelProfile
from solver.plan import build_plan
from solver.throughput import predict_throughput
from tools.bench.markdown import table

WINDOWS = [10, 10, 10]


def predicted_row(devices: tuple[DeviceProfile, ...], manifest: dict, windows: list[int], concurrency: int,
                  max_batch: int | None = None, micro_batches: int | None = None) -> dict:
    """The prediction for M requests on these windows (k from their sum; every node in the ring, on its CPU)."""
    inst = Instance(devices, ModelProfile.from_json(manifest), n_ctx=KV_RESERVE_TOKENS)
    plan = build_plan(inst, inst.model.n_layers // sum(windows), windows, [0] * len(windows),
                      [True] * len(windows), 0.0, "fixed")
    t = predict_throughput(plan, inst, concurrency, max_batch, micro_batches)
    return {"concurrency": concurrency, "aggregate_tps": t.aggregate_tps, "tpot_ms_per_request": t.tpot_s * 1e3,
            "mode": t.mode, "bottleneck": t.bottleneck, "max_batch": t.max_batch, "micro_batches": t.micro_batches,
            "round_trip_ms": t.round_trip_s * 1e3, "latency_bound": t.latency_bound,
            "buffers": [d.buffer_layers for d in plan.devices]}


def predict_live(head: str, token: str | None, concurrencies: list[int], max_batch: int | None = None,
                 micro_batches: int | None = None, refresh: bool = False) -> list[dict]:
    """Rows of predicted_row for the ring at `head` as it is assigned now, profiled live (cached per node)."""
    _, windows = assignment(ring.walk(head, token))
    profiles, manifest = profile_ring(head, token, refresh)
    devices = devices_from_json(profiles)
    return [predicted_row(devices, manifest, windows, m, max_batch, micro_batches) for m in concurrencies]


def loopback_rows(store: Path, concurrencies: list[int], logs: Path, extra: list[list[str]] | None) -> list[dict]:
    """Start 3 nodes, assign WINDOWS, profile, predict for each M with the batching best for it."""
    from prima_rpc.app.local_ring import launch

    local = launch(store, 3, log_dir=logs, extra_args=extra, detach=False, timeout=180)
    try:
        ring.start(local.addresses[0], WINDOWS)
        profiles, manifest = profile_ring(local.addresses[0], None, refresh=True)
        devices = devices_from_json(profiles)
        return [predicted_row(devices, manifest, WINDOWS, m) for m in concurrencies]
    finally:
        local.stop()


def main() -> None:
    from nodes.engine.store import LayerStore
    from tools.bench.bench_prediction import budgets
    from tools.default_model import ensure_default_store

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dtype", default=None, help="the default store's dtype (default: float32, as bench_prediction)")
    p.add_argument("--offload", default="0.6:200", help="FRACTION:MBPS of the offloading ring ('' skips it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    store = ensure_default_store(dtype=args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        rows += [r | {"ring": "resident"} for r in loopback_rows(store, args.concurrency, Path(logs), None)]
        if args.offload:
            fraction, mbps = (float(x) for x in args.offload.split(":"))
            os.environ[DISK_MBPS_ENV] = str(mbps)
            try:
                extra = [["--mem-budget", str(b)] for b in budgets(store, fraction)]
                rows += [r | {"ring": f"offload {fraction:.0%}, {mbps:g} MB/s"}
                         for r in loopback_rows(store, args.concurrency, Path(logs), extra)]
            finally:
                os.environ.pop(DISK_MBPS_ENV, None)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"predicted, {LayerStore(store).manifest.name} {LayerStore(store).manifest.dtype}, 3 nodes on loopback, "
          f"windows {WINDOWS}")
    print(table(["ring", "M", "max_batch", "micro_batches", "aggregate tok/s", "TPOT ms/request", "bottleneck"],
                ([r["ring"], r["concurrency"], r["max_batch"], r["micro_batches"], f"{r['aggregate_tps']:.1f}",
                  f"{r['tpot_ms_per_request']:.1f}", r["bottleneck"]] for r in rows), right=range(1, 6)))


if __name__ == "__main__":
    main()
