"""Mixture of experts under a memory budget: bytes read and TPOT of a Qwen3-30B-A3B-shaped int4 ring whose nodes hold
a share of their experts, the policy the expert cache uses, and Halda's plan for the whole model on D1-D4.

    python -m tools.bench.bench_moe [--layers 6] [--fraction 0.3] [--disk-mbps 500] [--tokens 8]

The store is synthetic (seeded random int4 weights, the real shapes: 128 experts, top-8, hidden 2048), `--layers`
of its 48, made on first use. Side by side in one run, on fresh loopback node processes (one node per `--layers /
3` layers, k = 1): every expert resident (its TPOT is the compute), and budgets of `--fraction` of each node's
share of layer bytes (beside its head and KV reserve), each node reading from an emulated disk of `--disk-mbps`
($PRIMA_DISK_MBPS, as bench_offload paces it). Bytes read per token are the nodes' reader counters, against the
routed experts' bytes (top-k of every layer: what a token must read at least when nothing is cached) and against
every expert of every layer (what streaming layers whole reads). Then: the routing a single process records over
the same store, replayed through each eviction policy at a few cache sizes (nodes/engine/expert_policy.py), and
Halda's plans for Qwen3-30B-A3B and the dense Qwen2.5-32B, both int4, on prima.cpp's D1-D4 testbed as published
and with its GPUs off.
"""

import argparse
import asyncio
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from nodes.engine.diskio import DISK_MBPS_ENV
from nodes.engine.expert_policy import POLICIES, hit_rate
from nodes.engine.formats import weight_format
from nodes.engine.fused import head_bytes, kv_bytes, layer_bytes
from nodes.engine.prefetch import KV_RESERVE_TOKENS
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from prima_rpc.app import ring
from prima_rpc.app.local_ring import launch
from prima_rpc.client import Finished, PrimaClient
from prima_rpc.spec.home import prima_home
from prima_rpc.spec.manifest import expert_unit
from prima_rpc.spec.profiles import load_profiles
from prima_rpc.spec.windows import Windows
from solver.strategies import plan_for
from tools.synth import synth

MB = 1e6
PROMPT = "Once upon a time"
SEED = 7
LEAD = 4  # tokens of the request whose bytes are taken off: its prefill and first steps
TESTBED = Path(__file__).resolve().parents[2] / "solver" / "testbeds" / "prima_d1_d4.json"


def ensure_store(path: Path | None, layers: int) -> Path:
    path = path or prima_home() / "models" / f"synthetic-qwen3-30b-a3b-int4-{layers}"
    if not (path / "manifest.json").is_file():
        print(f"writing a {layers}-layer int4 Qwen3-30B-A3B-shaped store to {path} ...", flush=True)
        synth(path, "qwen3-30b-a3b", dtype="int4", layers=layers, overwrite=True)
    return path


def budgets(store: LayerStore, share: list[int], fraction: float) -> list[int]:
    """Each node's head (the first) and KV reserve, and `fraction` of its share of layer bytes."""
    cfg, m = store.config, store.manifest
    lb = layer_bytes(cfg, torch.bfloat16, weight_format(m))
    head = head_bytes(cfg, torch.bfloat16, weight_format(m, "embed"))
    return [kv_bytes(cfg, torch.bfloat16, w, KV_RESERVE_TOKENS) + (head if i == 0 else 0) + int(fraction * w * lb)
            for i, w in enumerate(share)]


async def generate(head: str, tokens: int, seed: int = SEED) -> Finished:
    """Sampled (seeded: every configuration gets the same tokens), so that tokens, and routing, vary as in real
    text (a random model's greedy text repeats one token); no speculation (one token a trip)."""
    async with PrimaClient(head) as client:
        done = None
        async for event in client.generate(PROMPT, max_tokens=tokens, raw=True, temperature=1.0, seed=seed,
                                           speculate="off"):
            if isinstance(event, Finished):
                done = event
        return done


def run(store: Path, share: list[int], mem: list[int], tokens: int, logs: Path) -> dict:
    """One configuration on fresh node processes: TPOT and each node's disk bytes per decode token (the bytes of
    a request of LEAD + tokens tokens less those of one of LEAD, sampled with another seed so that its tokens are
    not the longer one's and leave it no experts cached ahead: the prompt's prefill and first tokens left out)."""
    extra = [(["--mem-budget", str(b)] if b else []) + ["--dtype", "bfloat16"] for b in mem]
    local = launch(store, len(share), log_dir=logs, extra_args=extra, detach=False, timeout=300)
    try:
        ring.start(local.addresses[0], share)
        asyncio.run(generate(local.addresses[0], 3))  # warm-up
        walk = lambda: [info for _, info in ring.walk(local.addresses[0])]  # noqa: E731
        start = walk()
        asyncio.run(generate(local.addresses[0], LEAD, SEED + 1))
        before = walk()
        done = asyncio.run(generate(local.addresses[0], LEAD + tokens))
        after = walk()
    finally:
        local.stop()

    def per_token(field: str) -> list[float]:  # the longer request's less the shorter one's
        return [((getattr(a.stats, field) - getattr(b.stats, field)) - (getattr(b.stats, field) -
                 getattr(s.stats, field))) / tokens for s, b, a in zip(start, before, after)]

    return {"tpot_ms": done.tpot_ms, "tokens": tokens, "node_bytes": per_token("disk_read_bytes"),
            "resident": [a.stats.resident_bytes for a in after], "budgets": [a.mem_budget for a in after]}


def ring_bench(store_dir: Path, args) -> None:
    store = LayerStore(store_dir)
    cfg = store.config
    share = [cfg.n_layers // args.nodes] * args.nodes
    share[0] += cfg.n_layers - sum(share)
    one = store.entry(expert_unit(0, 0)).bytes
    routed = cfg.n_layers * cfg.n_experts_used * one  # a token's experts, nothing cached
    every = cfg.n_layers * cfg.n_experts * one
    mem = budgets(store, share, args.fraction)
    with tempfile.TemporaryDirectory() as logs:
        resident = run(store_dir, share, [0] * args.nodes, args.tokens, Path(logs))
        print(json.dumps({"config": "resident", **resident}), flush=True)
        os.environ[DISK_MBPS_ENV] = str(args.disk_mbps)
        try:
            capped = run(store_dir, share, mem, args.tokens, Path(logs))
        finally:
            os.environ.pop(DISK_MBPS_ENV, None)
        print(json.dumps({"config": f"{args.fraction:.0%}", **capped}), flush=True)
    read = sum(capped["node_bytes"])
    reads_ms = sum(capped["node_bytes"]) / (args.disk_mbps * MB) * 1e3  # one request: the nodes read in turn
    bound = max(resident["tpot_ms"], reads_ms)
    print(f"\n{cfg.n_layers} layers of Qwen3-30B-A3B int4 ({cfg.n_experts} experts of {one / MB:.2f} MB, top-"
          f"{cfg.n_experts_used}), nodes {share}, budgets {[f'{b / 2**20:.0f}' for b in mem]} MiB "
          f"({args.fraction:.0%} of each share), disks {args.disk_mbps:g} MB/s each, {capped['tokens']} tokens")
    print("\n| configuration | MB read/token | x routed experts | every expert / read | reads | compute | bound "
          "| TPOT | TPOT/bound |\n|---|---|---|---|---|---|---|---|---|")
    print(f"| all resident | 0 | - | - | - | {resident['tpot_ms']:.0f} ms | - | **{resident['tpot_ms']:.0f} ms** "
          "| - |")
    print(f"| {args.fraction:.0%} budget | {read / MB:.1f} | {read / routed:.2f}x | {every / max(read, 1):.1f}x "
          f"| {reads_ms:.0f} ms | {resident['tpot_ms']:.0f} ms | {bound:.0f} ms | **{capped['tpot_ms']:.0f} ms** "
          f"| {capped['tpot_ms'] / bound:.2f} |")
    print(f"\nrouted experts' bytes a token: {routed / MB:.1f} MB; every expert of every layer: {every / MB:.0f} MB")


def policy_bench(store_dir: Path, tokens: int, shares: list[float]) -> None:
    """The routing of one process over the store (sampled decode, as `run`), replayed through each policy."""
    store = LayerStore(store_dir)
    cfg = store.config
    layers = list(range(cfg.n_layers))
    shard = Shard(store, Windows(((0, cfg.n_layers),), cfg.n_layers, True), torch.bfloat16,
                  budget=budgets(store, [cfg.n_layers], 0.1)[0])
    prompt = list(b"Once upon a time, in a land far away, there lived")
    kv = shard.cache_for("r", 0, len(prompt) + tokens, len(prompt))
    h, _ = shard.compute(shard.embed(prompt), kv, 0, 0)
    start = len(shard.experts.routed)  # the prefill's routing chose for many rows at once: decode only
    g = torch.Generator().manual_seed(SEED)
    sample = lambda h: int(torch.multinomial(shard.logits(h).softmax(-1), 1, generator=g))  # noqa: E731 (run's)
    ids = [sample(h)]
    for step in range(tokens - 1):
        h, _ = shard.compute(shard.embed(ids[-1:]), kv, len(prompt) + step, 0)
        ids.append(sample(h))
    trace = shard.experts.routed[start:]
    shard.close()
    print(f"\nexpert cache hit rate on {len(trace) // cfg.n_layers} decode steps' routing ({cfg.n_layers} layers, "
          f"{cfg.n_experts} experts, top-{cfg.n_experts_used}), by cache size (share of all experts)\n")
    print("| policy | " + " | ".join(f"{s:.0%}" for s in shares) + " |\n|---|" + "---|" * len(shares))
    total = cfg.n_layers * cfg.n_experts
    for name, policy in POLICIES.items():
        rates = [hit_rate(trace, layers, cfg.n_experts, int(s * total), policy()) for s in shares]
        print(f"| {name} | " + " | ".join(f"{r:.1%}" for r in rates) + " |")
    print("| uniform routing (the plan's assumption) | " + " | ".join(f"{s:.1%}" for s in shares) + " |")


def plan_bench(out: Path) -> None:
    """Halda on D1-D4 for Qwen3-30B-A3B and Qwen2.5-32B at int4 (manifest-only stores: real file sizes)."""
    published = load_profiles(TESTBED)
    cpu = tuple(replace(d, gpu_kind="none", vram_free=0, gpu_flops=0) for d in published)
    print("\n| testbed | model | GiB | predicted TPOT | k | windows (set) | expert reads MB/token |")
    print("|---|---|---|---|---|---|---|")
    for testbed, devices in (("D1-D4", published), ("D1-D4, GPUs off", cpu)):
        for name in ("qwen3-30b-a3b", "qwen2.5-32b"):
            store = synth(out / name, name, dtype="int4", manifest_only=True, overwrite=True)
            manifest = json.loads((store / "manifest.json").read_text())
            size = sum(f.bytes for f in LayerStore(store).manifest.units().values()) / 2**30
            p = plan_for(devices, manifest)
            if "infeasible" in p:
                print(f"| {testbed} | {name} | {size:.1f} | infeasible: {p['infeasible']} | | | |")
                continue
            shape = " ".join(f"{d['name']}:{d['window']}({d['set']})" for d in p["devices"])
            reads = " ".join(f"{d.get('expert_bytes_per_token', 0) / MB:.0f}" for d in p["devices"]) if \
                "experts" in p else "-"
            print(f"| {testbed} | {name} | {size:.1f} | {p['predicted_tpot_ms']:.1f} ms | {p['k']} | {shape} "
                  f"| {reads} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", type=Path, default=None, help="store directory (default: a synthetic one, made once)")
    p.add_argument("--layers", type=int, default=6, help="layers of the synthetic store (of 48; ~350 MB each)")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--fraction", type=float, default=0.3, help="each node's budget: this share of its layer bytes")
    p.add_argument("--disk-mbps", type=float, default=500, help="each node's emulated disk")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--trace-tokens", type=int, default=24, help="decode steps whose routing the policies replay")
    p.add_argument("--only", choices=["ring", "policy", "plan"], help="one part only")
    args = p.parse_args()
    store = None if args.only == "plan" else ensure_store(args.store, args.layers)
    if args.only in (None, "ring"):
        ring_bench(store, args)
    if args.only in (None, "policy"):
        policy_bench(store, args.trace_tokens, [0.1, 0.25, 0.5])
    if args.only in (None, "plan"):
        with tempfile.TemporaryDirectory() as out:
            plan_bench(Path(out))


if __name__ == "__main__":
    main()
