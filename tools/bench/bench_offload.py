"""Disk offload: TPOT of a loopback ring whose nodes' budgets are below their share, with and without
prefetch, beside the bound max(compute time, bytes read / disk bandwidth), all measured in one run.

    python -m tools.bench.bench_offload [--store DIR] [--layers 72] [--nodes 3] [--fractions 0.5 0.8]
    python -m tools.bench.bench_offload --read-bench   # read mechanisms side by side

The store is a synthetic Llama-shaped model (preset offload-1g: 45 MB fp32 layers; 72 layers = 3.2 GB),
made on first use. Per budget (a fraction of each node's share of layer bytes, on top of its head and KV
reserve) it starts fresh node processes for: prefetch on (PRIMA_PREFETCH_DEPTH unset: the default
depth), prefetch off (depth 0: each streamed layer is read when needed), and one node holding the whole
model with the ring's total budget (llama.cpp-style single machine). "Compute" is the TPOT of the same
shape with every layer resident. Disk bandwidth is measured with the nodes' own read path (O_DIRECT chunks
into a layer buffer) in as many processes at once as the configuration has nodes (one process alone gets
less from this disk than several together), before and after every run; all nodes share this one disk, so
the disk time of a token is the bytes all nodes read for it over that bandwidth. Configurations run
interleaved, `--repeats` times each, and the table shows medians.

    python -m tools.bench.bench_offload --disk-mbps 250 --rounds 1 3 --fractions 0.8

emulates a disk of that speed per node ($PRIMA_DISK_MBPS: real reads, paced), as devices of a home each
have one: the disk time of a token is then the largest bytes one node reads for it over that bandwidth,
and `--rounds` adds piped-ring shapes (k rounds of windows) that give each node k gaps to read ahead in.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nodes.engine.diskio import DISK_MBPS_ENV
from nodes.engine.formats import weight_format
from nodes.engine.fused import head_bytes, kv_bytes, layer_bytes
from nodes.engine.prefetch import DEPTH_ENV, KV_RESERVE_TOKENS
from nodes.engine.store import LayerStore
from prima_rpc.app import ring
from prima_rpc.app.local_ring import launch
from prima_rpc.client import Finished, PrimaClient
from prima_rpc.spec.home import prima_home
from tools.bench.read_paths import read_bench
from tools.synth import synth

PROMPT = "Once upon a time"
MB = 1 << 20


def ensure_store(path: Path | None, layers: int, dtype: str = "float32") -> Path:
    path = path or prima_home() / "models" / ("synthetic-offload-" + (f"{dtype}-" if dtype != "float32" else "")
                                              + f"{layers}")
    if not (path / "manifest.json").is_file():
        print(f"writing a {layers}-layer {dtype} synthetic store to {path} ...", flush=True)
        synth(path, "offload-1g", layers=layers, dtype=dtype, overwrite=True)
    return path


def _read_for(store_dir: Path, start: int, seconds: float) -> tuple[int, float]:
    """(bytes, seconds) of the nodes' read path (O_DIRECT chunks, memmove into a fused layer) reading layer
    files from `start` on, in turn, for about `seconds`. Runs in a worker process."""
    store = LayerStore(store_dir, verify=False)
    cfg = store.config
    targets = {name: torch.empty(s.shape, dtype=s.dtype) for name, s in store.layout("layer.0").items()}
    store.read_into(f"layer.{(start - 1) % cfg.n_layers}", targets)  # first touch of the buffers
    n, j, begin = 0, 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        n += store.read_into(f"layer.{(start + j) % cfg.n_layers}", targets)
        j += 1
    return n, time.perf_counter() - begin


class Disk:
    """Read bandwidth of the store's disk, as `readers` processes reading at once get it (nodes are processes:
    several of them reading together get more from this disk than one)."""

    def __init__(self, store_dir: Path, readers: int):
        self.store_dir, self.readers = store_dir, readers
        self.pool = multiprocessing.get_context("spawn").Pool(readers)

    def bandwidth(self, start: int = 0, seconds: float = 2.0, readers: int | None = None) -> float:
        readers = readers or self.readers
        n_layers = LayerStore(self.store_dir).config.n_layers
        jobs = [(self.store_dir, start + r * n_layers // readers, seconds) for r in range(readers)]
        out = self.pool.starmap(_read_for, jobs, chunksize=1)
        return sum(n for n, _ in out) / max(t for _, t in out)

    def close(self) -> None:
        self.pool.terminate()


async def generate(head: str, tokens: int) -> Finished:
    async with PrimaClient(head) as client:
        done = None
        async for event in client.generate(PROMPT, max_tokens=tokens, raw=True):
            if isinstance(event, Finished):
                done = event
        return done


def run(store: Path, windows: list[int], budgets: list[int], depth: int | None, tokens: int, logs: Path,
        buffer_layers: float = 0.0, dtype: str = "float32") -> dict:
    """One configuration on fresh node processes: TPOT and per-token disk bytes, stall and compute.
    buffer_layers: every node's stream buffer (0: the node's default)."""
    if depth is None:
        os.environ.pop(DEPTH_ENV, None)
    else:
        os.environ[DEPTH_ENV] = str(depth)
    extra = [(["--mem-budget", str(b)] if b else []) + ["--dtype", dtype] for b in budgets]
    local = launch(store, len(windows), log_dir=logs, extra_args=extra, detach=False, timeout=120)
    try:
        ring.start(local.addresses[0], windows, buffers=[buffer_layers] * len(windows))
        asyncio.run(generate(local.addresses[0], 3))  # warm-up
        before = [info for _, info in ring.walk(local.addresses[0])]
        done = asyncio.run(generate(local.addresses[0], tokens))
        after = [info for _, info in ring.walk(local.addresses[0])]
    finally:
        local.stop()
        os.environ.pop(DEPTH_ENV, None)
    n = done.completion_tokens  # passes over the layers: the prefill one and n - 1 decode steps

    def per_token(field: str) -> float:
        return sum(getattr(a.stats, field) - getattr(b.stats, field) for a, b in zip(after, before)) / n

    node_bytes = [(a.stats.disk_read_bytes - b.stats.disk_read_bytes) / n for a, b in zip(after, before)]
    return {"tpot_ms": done.tpot_ms, "tokens": n, "disk_bytes_per_token": per_token("disk_read_bytes"),
            "node_disk_bytes_per_token": node_bytes,
            "stall_ms_per_token": per_token("stall_s") * 1e3, "compute_ms_per_token": per_token("compute_s") * 1e3,
            "budgets": [a.mem_budget for a in after], "resident_bytes": [a.stats.resident_bytes for a in after],
            "rss_bytes": [a.stats.rss_bytes for a in after]}


def bench(args) -> None:
    store = ensure_store(args.store, args.layers, args.dtype)
    manifest = LayerStore(store).manifest
    cfg, fmt, hfmt = manifest.config, weight_format(manifest), weight_format(manifest, "embed")
    # float32 stores compute in float32, the others in bfloat16 (nodes get --dtype: bfloat16 stores too)
    compute = "float32" if manifest.dtype == "float32" else "bfloat16"
    n_layers, n, dtype = cfg.n_layers, args.nodes, getattr(torch, compute)
    share = [n_layers // n] * n  # layers per node
    share[0] += n_layers - sum(share)
    lb = layer_bytes(cfg, dtype, fmt)
    fixed = [kv_bytes(cfg, dtype, w, KV_RESERVE_TOKENS) + (head_bytes(cfg, dtype, hfmt) if i == 0 else 0)
             for i, w in enumerate(share)]
    rings = {k: f"ring of {n}" + (f", k={k}" if len(args.rounds) > 1 else "") for k in args.rounds}
    for k in args.rounds:
        if any(w % k for w in share):
            raise SystemExit(f"--rounds {k}: the node shares {share} are not multiples of {k}")
    # (group, name, budgets, depth, windows): windows per node and round, so k = layers / sum(windows)
    configs = [("compute", f"{name}, all resident", [0] * n, None, [w // k for w in share])
               for k, name in rings.items()] + [("compute", "1 node, all resident", [0], None, [n_layers])]
    for frac in args.fractions:
        budgets = [f + int(frac * w * lb) for f, w in zip(fixed, share)]
        single = head_bytes(cfg, dtype, hfmt) + kv_bytes(cfg, dtype, n_layers, KV_RESERVE_TOKENS) + sum(
            b - f for b, f in zip(budgets, fixed))
        for k, name in rings.items():
            configs += [(f"{frac:.0%}", f"{name}, prefetch", budgets, None, [w // k for w in share]),
                        (f"{frac:.0%}", f"{name}, no prefetch", budgets, 0, [w // k for w in share])]
        configs += [(f"{frac:.0%}", "1 node, prefetch", [single], None, [n_layers]),
                    (f"{frac:.0%}", "1 node, no prefetch", [single], 0, [n_layers])]
    meta = {"store": str(store), "dtype": manifest.dtype, "layers": n_layers, "layer_mib": lb / MB, "windows": share,
            "tokens": args.tokens, "repeats": args.repeats, "disk_mbps": args.disk_mbps}
    if args.disk_mbps:
        os.environ[DISK_MBPS_ENV] = str(args.disk_mbps)  # the nodes' and the bandwidth probes' reads
    print(json.dumps({"meta": meta}), flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    disk = Disk(store, n)
    try:
        with tempfile.TemporaryDirectory() as logs:
            for rep in range(args.repeats):  # interleaved, alternating order: drifts of the shared box hit all alike
                for group, name, budgets, depth, shape in (configs if rep % 2 == 0 else configs[::-1]):
                    offset = 7 * sum(len(v) for v in runs.values())
                    before = disk.bandwidth(start=offset, readers=len(shape))  # one reader process per node
                    r = run(store, shape, budgets, depth, args.tokens, Path(logs), args.buffer_layers, compute)
                    r["disk_bw"] = [before, disk.bandwidth(start=offset + 3, readers=len(shape))]
                    runs.setdefault((group, name), []).append(r)
                    print(json.dumps({"config": [group, name], **r}), flush=True)
    finally:
        disk.close()
    report(meta, runs)


def report(meta: dict, runs: dict[tuple[str, str], list[dict]]) -> None:
    """The table: medians per configuration; disk time at the best bandwidth the disk gave in the run."""

    def med(key, field):
        return statistics.median(r[field] for r in runs[key])

    def samples(one_node: bool) -> list[float]:
        return [bw for (_, name), rs in runs.items() if name.startswith("1 node") == one_node
                for r in rs for bw in (r["disk_bw"] if isinstance(r["disk_bw"], list) else [r["disk_bw"]])]

    n = len(meta["windows"])
    per_node = bool(meta.get("disk_mbps"))  # an emulated disk per node, or the one disk all nodes share
    peak = {False: max(samples(False)), True: max(samples(True))}
    if per_node:  # the ring's probes read with one process per node at once: each node's disk gave 1/n
        peak[False] /= n
    print(f"\nstore {meta['store']}: {meta['layers']} layers x {meta['layer_mib']:.0f} MiB "
          f"{meta.get('dtype', 'float32')} = "
          f"{meta['layers'] * meta['layer_mib'] / 1024:.2f} GiB; layers per node {meta['windows']}; "
          f"{meta['tokens']} tokens per run, median of {meta['repeats']} interleaved runs.")
    if per_node:
        print(f"each node has its own emulated disk of {meta['disk_mbps']} MB/s; measured per node "
              f"{peak[False] / 1e6:.0f} MB/s with all {n} reading at once, {peak[True] / 1e6:.0f} MB/s alone "
              "(peaks); disk time = the bytes of the node that reads most / its disk's bandwidth")
    else:
        for one_node, who in ((False, f"{n} reader processes at once"), (True, "one reader process")):
            v = samples(one_node)
            print(f"disk bandwidth, {who}, before and after every run: {min(v) / 1e9:.2f}-{max(v) / 1e9:.2f} "
                  f"GB/s (median {statistics.median(v) / 1e9:.2f}); the bound uses the peak, {max(v) / 1e9:.2f} GB/s")
    print("\n| budget/node | configuration | budget | MB read/token | disk time at peak bw | compute | bound "
          "| TPOT | TPOT/bound | read rate | stall/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key in runs:
        group, name = key
        compute = med(("compute", name.rsplit(", ", 1)[0] + ", all resident"), "tpot_ms")
        if per_node and "node_disk_bytes_per_token" in runs[key][0]:
            read = statistics.median(max(r["node_disk_bytes_per_token"]) for r in runs[key])
        else:
            read = med(key, "disk_bytes_per_token")
        disk_ms = read / peak[name.startswith("1 node")] * 1e3
        bound, tpot = max(compute, disk_ms), med(key, "tpot_ms")
        budget = "/".join(f"{b / MB:.0f}" for b in runs[key][0]["budgets"]) + " MiB" if group != "compute" else "-"
        print(f"| {group} | {name} | {budget} | {med(key, 'disk_bytes_per_token') / 1e6:.0f} | {disk_ms:.0f} ms | "
              f"{compute:.0f} ms | {bound:.0f} ms | **{tpot:.0f} ms** | {tpot / bound:.2f} | "
              f"{med(key, 'disk_bytes_per_token') / tpot / 1e6:.2f} GB/s | {med(key, 'stall_ms_per_token'):.0f} ms |")
    print()
    shapes = dict.fromkeys(name.rsplit(", ", 1)[0] for g, name in runs if g != "compute")
    for group in dict.fromkeys(g for g, _ in runs if g != "compute"):
        for shape in shapes:
            pf, nopf = runs[(group, f"{shape}, prefetch")], runs[(group, f"{shape}, no prefetch")]
            each = " ".join(f"{b['tpot_ms'] / a['tpot_ms']:.2f}" for a, b in zip(pf, nopf))
            ratio = med((group, f"{shape}, no prefetch"), "tpot_ms") / med((group, f"{shape}, prefetch"), "tpot_ms")
            print(f"budget {group} of share, {shape}: TPOT no prefetch / prefetch = {ratio:.2f}x (runs: {each})")


def load_log(path: Path) -> tuple[dict, dict[tuple[str, str], list[dict]]]:
    """A previous run's JSON lines, to print its table again."""
    meta, runs = {}, {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if "meta" in row:
                meta = row["meta"]
            else:
                runs.setdefault(tuple(row.pop("config")), []).append(row)
    return meta, runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", type=Path, default=None, help="store directory (default: a synthetic one, made once)")
    p.add_argument("--layers", type=int, default=72, help="layers of the synthetic store (45 MB each)")
    p.add_argument("--dtype", default="float32", help="weights of the synthetic store: float32, bfloat16, int8, "
                   "int4 (the nodes compute in bfloat16 for all but float32)")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.8],
                   help="each node's layer budget as a fraction of its share of layer bytes")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs of each offload configuration (interleaved)")
    p.add_argument("--disk-mbps", type=float, default=0,
                   help="emulate a disk of this many MB/s per node (default: the machine's one shared disk)")
    p.add_argument("--rounds", type=int, nargs="+", default=[1],
                   help="ring shapes to run: k rounds of windows per token (default: 1)")
    p.add_argument("--buffer-layers", type=float, default=0.0,
                   help="every node's stream buffer in layers, as a plan would set it (0: the node's default, 2)")
    p.add_argument("--read-bench", action="store_true", help="compare read mechanisms instead")
    p.add_argument("--table", type=Path, help="print the table of a previous run's output again")
    args = p.parse_args()
    if args.table:
        report(*load_log(args.table))
    elif args.read_bench:
        read_bench(ensure_store(args.store, args.layers))
    else:
        bench(args)


if __name__ == "__main__":
    main()
