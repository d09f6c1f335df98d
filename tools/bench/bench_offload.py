"""Disk offload: TPOT of a loopback ring whose nodes' budgets are below their share, with and without
prefetch, beside the bound max(compute time, bytes read / disk bandwidth), all measured in one run.

    python -m tools.bench.bench_offload [--store DIR] [--layers 72] [--nodes 3] [--fractions 0.5 0.8]
    python -m tools.bench.bench_offload --read-bench   # read mechanisms side by side

The store is a synthetic Llama-shaped model (preset offload-1g: 45 MB fp32 layers; 72 layers = 3.2 GB),
made on first use. Per budget (a fraction of each node's share of layer bytes, on top of its head and KV
reserve) it starts fresh node processes for: prefetch on (PRIMA_PREFETCH_DEPTH unset: the default
depth), prefetch off (depth 0: each streamed layer is read when needed), and one node holding the whole
model with the ring's total budget (llama.cpp-style single machine). "Compute" is the TPOT of the same
ring with every layer resident. Disk bandwidth is measured with the nodes' own reader (O_DIRECT chunks
into a layer buffer) before and after every configuration; all nodes share this one disk, so the disk
time of a token is the bytes all nodes read for it over that bandwidth.
"""

import argparse
import asyncio
import json
import mmap
import os
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nodes.fused import empty_layer, head_bytes, kv_bytes, layer_bytes, layer_targets
from nodes.prefetch import DEPTH_ENV, KV_RESERVE_TOKENS
from nodes.store import LayerStore
from prima_rpc import ring
from prima_rpc.client import Finished, PrimaClient
from prima_rpc.local_ring import launch
from tools.default_model import prima_home
from tools.synth import synth

PROMPT = "Once upon a time"
MB = 1 << 20


def ensure_store(path: Path | None, layers: int) -> Path:
    path = path or prima_home() / "models" / f"synthetic-offload-{layers}"
    if not (path / "manifest.json").is_file():
        print(f"writing a {layers}-layer synthetic store to {path} ...", flush=True)
        synth(path, "offload-1g", layers=layers, overwrite=True)
    return path


def disk_bandwidth(store_dir: Path, files: int = 8, start: int = 0) -> float:
    """B/s of the nodes' read path (O_DIRECT chunks, memmove into a fused layer) over `files` layer files."""
    store = LayerStore(store_dir, verify=False)
    cfg = store.config
    targets = layer_targets(empty_layer(cfg, torch.float32), cfg)
    units = [f"layer.{(start + i) % cfg.n_layers}" for i in range(files)]
    store.read_into(units[0], targets)  # first touch of the buffers
    begin = time.perf_counter()
    total = sum(store.read_into(u, targets) for u in units)
    return total / (time.perf_counter() - begin)


async def generate(head: str, tokens: int) -> Finished:
    async with PrimaClient(head) as client:
        done = None
        async for event in client.generate(PROMPT, max_tokens=tokens, raw=True):
            if isinstance(event, Finished):
                done = event
        return done


def run(store: Path, windows: list[int], budgets: list[int], depth: int | None, tokens: int, logs: Path) -> dict:
    """One configuration on fresh node processes: TPOT and per-token disk bytes, stall and compute."""
    if depth is None:
        os.environ.pop(DEPTH_ENV, None)
    else:
        os.environ[DEPTH_ENV] = str(depth)
    extra = [["--mem-budget", str(b)] if b else [] for b in budgets]
    local = launch(store, len(windows), log_dir=logs, extra_args=extra, detach=False, timeout=120)
    try:
        ring.start(local.addresses[0], windows)
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

    return {"tpot_ms": done.tpot_ms, "tokens": n, "disk_bytes_per_token": per_token("disk_read_bytes"),
            "stall_ms_per_token": per_token("stall_s") * 1e3, "compute_ms_per_token": per_token("compute_s") * 1e3,
            "budgets": [a.mem_budget for a in after], "resident_bytes": [a.stats.resident_bytes for a in after],
            "rss_bytes": [a.stats.rss_bytes for a in after]}


def bench(args) -> None:
    store = ensure_store(args.store, args.layers)
    cfg = LayerStore(store).config
    n_layers, n, dtype = cfg.n_layers, args.nodes, torch.float32
    windows = [n_layers // n] * n
    windows[0] += n_layers - sum(windows)
    lb = layer_bytes(cfg, dtype)
    fixed = [kv_bytes(cfg, dtype, w, KV_RESERVE_TOKENS) + (head_bytes(cfg, dtype) if i == 0 else 0)
             for i, w in enumerate(windows)]
    configs: list[tuple[str, str, list[int], int | None, list[int]]] = []  # (group, name, budgets, depth, windows)
    for frac in args.fractions:
        budgets = [f + int(frac * w * lb) for f, w in zip(fixed, windows)]
        single = head_bytes(cfg, dtype) + kv_bytes(cfg, dtype, n_layers, KV_RESERVE_TOKENS) + sum(
            b - f for b, f in zip(budgets, fixed))
        configs += [(f"{frac:.0%}", f"ring of {n}, prefetch", budgets, None, windows),
                    (f"{frac:.0%}", f"ring of {n}, no prefetch", budgets, 0, windows),
                    (f"{frac:.0%}", "1 node, prefetch", [single], None, [n_layers]),
                    (f"{frac:.0%}", "1 node, no prefetch", [single], 0, [n_layers])]
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)

        def measured(key: tuple[str, str], budgets: list[int], depth: int | None, shape: list[int]) -> None:
            offset = 8 * sum(len(v) for v in runs.values())
            bw0 = disk_bandwidth(store, start=offset)
            r = run(store, shape, budgets, depth, args.tokens, logs)
            r["disk_bw"] = (bw0 + disk_bandwidth(store, start=offset + 4)) / 2
            runs.setdefault(key, []).append(r)
            print(json.dumps({"config": key, **r}), flush=True)

        measured(("compute", f"ring of {n}, all resident"), [0] * n, None, windows)
        measured(("compute", "1 node, all resident"), [0], None, [n_layers])
        for rep in range(args.repeats):  # interleaved, alternating order: drifts of the shared box hit all alike
            for group, name, budgets, depth, shape in (configs if rep % 2 == 0 else configs[::-1]):
                measured((group, name), budgets, depth, shape)

    def med(key, field):
        return statistics.median(r[field] for r in runs[key])

    bws = [r["disk_bw"] for rs in runs.values() for r in rs]
    print(f"\nstore {store}: {n_layers} layers x {lb / MB:.0f} MiB fp32 = {n_layers * lb / 2**30:.2f} GiB; "
          f"ring windows {windows} (k=1); {args.tokens} tokens per run, median of {args.repeats} runs; disk bandwidth "
          f"{min(bws) / 1e9:.2f}-{max(bws) / 1e9:.2f} GB/s (median {statistics.median(bws) / 1e9:.2f})\n")
    print("| budget/node (share) | configuration | budget | MB read/token | disk time | compute | bound "
          "| TPOT | TPOT/bound | stall/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in runs:
        group, name = key
        compute = med(("compute", name.split(",")[0] + ", all resident"), "tpot_ms")
        disk_ms = med(key, "disk_bytes_per_token") / med(key, "disk_bw") * 1e3
        bound, tpot = max(compute, disk_ms), med(key, "tpot_ms")
        budget = "/".join(f"{b / MB:.0f}" for b in runs[key][0]["budgets"])
        print(f"| {group} | {name} | {budget} MiB | {med(key, 'disk_bytes_per_token') / 1e6:.0f} | {disk_ms:.0f} ms | "
              f"{compute:.0f} ms | {bound:.0f} ms | **{tpot:.0f} ms** | {tpot / bound:.2f} | "
              f"{med(key, 'stall_ms_per_token'):.0f} ms |")
    for frac in args.fractions:
        g = f"{frac:.0%}"
        for shape in (f"ring of {n}", "1 node"):
            ratio = med((g, f"{shape}, no prefetch"), "tpot_ms") / med((g, f"{shape}, prefetch"), "tpot_ms")
            print(f"budget {g} of share, {shape}: no prefetch / prefetch = {ratio:.2f}x")


# ------------------------------------------------------------------ read mechanisms


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def read_bench(args) -> None:
    """GB/s and reader CPU per layer of four read paths, alone and beside a decode-like compute thread."""
    store_dir = ensure_store(args.store, args.layers)
    store = LayerStore(store_dir, verify=False)
    cfg = store.config
    files = [store_dir / store.entry(f"layer.{i}").path for i in range(cfg.n_layers)]
    size = max(p.stat().st_size for p in files)
    buf = torch.frombuffer(mmap.mmap(-1, size + 64), dtype=torch.uint8)
    fused = layer_targets(empty_layer(cfg, torch.float32), cfg)

    def read_bytes(path):  # the old LayerStore.read_bytes + safetensors load: a fresh copy per read
        data = path.read_bytes()
        _drop(path)
        return len(data)

    def readinto(path):  # buffered into a reused buffer
        view = memoryview(buf.numpy())
        with open(path, "rb", buffering=0) as f:
            n = f.readinto(view[:path.stat().st_size])
        _drop(path)
        return n

    def mmap_touch(path):  # prima.cpp-style: map, MADV_WILLNEED, fault every page in
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            m.madvise(mmap.MADV_WILLNEED)
            pages = np.frombuffer(m, dtype=np.uint8)
            pages[::4096].sum()
            del pages
            m.madvise(mmap.MADV_DONTNEED)
            n = len(m)
        _drop(path)
        return n

    def direct(path):  # the nodes' path: O_DIRECT chunks in flight, memmove into the fused layer
        unit = f"layer.{files.index(path)}"
        return store.read_into(unit, fused)

    weights = [torch.randn(2 * cfg.intermediate, cfg.hidden) for _ in range(4)]
    x = torch.randn(1, cfg.hidden)

    def compute(stop: threading.Event, out: list) -> None:
        n = 0
        while not stop.is_set():
            for w in weights:
                F.linear(x, w)
            n += 1
        out.append(n)

    def rate(seconds=1.5) -> float:
        stop, out = threading.Event(), []
        t = threading.Thread(target=compute, args=(stop, out))
        t.start()
        time.sleep(seconds)
        stop.set()
        t.join()
        return out[0] / seconds

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_THREAD)
        return r.ru_utime + r.ru_stime

    alone = rate()
    methods = {"read() + fadvise (old path)": read_bytes, "buffered readinto + fadvise": readinto,
               "mmap + WILLNEED + touch": mmap_touch, "O_DIRECT chunks + memmove (nodes)": direct}
    per = max(2, min(6, len(files) // (2 * len(methods))))
    stats = {name: {"gbs": [], "cpu": [], "gbs_busy": [], "compute": []} for name in methods}
    i = 0
    for _ in range(2):  # two passes, methods interleaved: noise from the shared machine hits all alike
        for name, fn in methods.items():
            for busy in (False, True):
                chunk = [files[(i + j) % len(files)] for j in range(per)]
                i += per
                for p in chunk:
                    _drop(p)
                stop, out = threading.Event(), []
                t = threading.Thread(target=compute, args=(stop, out)) if busy else None
                if t:
                    t.start()
                c, begin = cpu(), time.perf_counter()
                total = sum(fn(p) for p in chunk)
                dt, dc = time.perf_counter() - begin, cpu() - c
                if t:
                    stop.set()
                    t.join()
                    stats[name]["gbs_busy"].append(total / dt / 1e9)
                    stats[name]["compute"].append(out[0] / dt / alone)
                else:
                    stats[name]["gbs"].append(total / dt / 1e9)
                    stats[name]["cpu"].append(dc / len(chunk) * 1e3)
    print(f"\n{len(files)} layer files of {size / MB:.0f} MB; compute alone {alone:.0f} it/s\n")
    print("| read path | GB/s alone | reader CPU ms/layer | GB/s beside compute | compute speed while reading |")
    print("|---|---|---|---|---|")
    for name, s in stats.items():
        print(f"| {name} | {statistics.mean(s['gbs']):.2f} | {statistics.mean(s['cpu']):.1f} | "
              f"{statistics.mean(s['gbs_busy']):.2f} | {statistics.mean(s['compute']):.0%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", type=Path, default=None, help="store directory (default: a synthetic one, made once)")
    p.add_argument("--layers", type=int, default=72, help="layers of the synthetic store (45 MB each)")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.8],
                   help="each node's layer budget as a fraction of its share of layer bytes")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs of each offload configuration (interleaved)")
    p.add_argument("--read-bench", action="store_true", help="compare read mechanisms instead")
    args = p.parse_args()
    (read_bench if args.read_bench else bench)(args)


if __name__ == "__main__":
    main()
