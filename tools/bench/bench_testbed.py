"""Plans measured on the home testbed: each strategy's plan applied to a live ring of unlike devices, its predicted
TPOT beside the measured, and each device's profile held against the limits the testbed set.

    python -m tools.bench.bench_testbed --preset d1-d4 --model STORE [--strategies halda exo even] [--tokens 8]
        [--base-port 17000] [--reuse] [--keep] [--json]

Brings the preset up (tools/testbed; or uses the testbed already up on --base-port with --reuse), profiles every
device (Control.Profile, one at a time), then for each strategy: `prima-ctl plan --strategy S --out FILE` on the
live ring, `prima-ctl start --plan FILE`, a warm-up request, and one greedy request of --tokens tokens
(speculation off) whose TPOT the client measures; `status --json` gives each node's measured per-token time
beside the plan's. Every strategy must give the same tokens. The profile check: compute per share of a core
(each device against the devices' mean), RAM against the device's limit, disk against its MB/s, one hop's latency
against both links' (and the software hop the same ring pays at zero latency is not subtracted: it is reported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prima_rpc.app.live_plan import profile_ring
from tools.testbed import bed
from tools.testbed.home import load_home

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def ctl(head: str, *args: str, timeout: float = 1800) -> str:
    done = subprocess.run([sys.executable, "-m", "prima_rpc.app.cli", "--node", head, *args], capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"prima-ctl {' '.join(args)}: {done.stderr.strip()[-500:]}")
    return done.stdout


def profile_check(record: dict, profiles: dict) -> list[dict]:
    """Each device's profile against its limits."""
    rows = []
    per_share = [p["cpu_flops"] / d["cpu"] for p, d in zip(profiles["devices"], record["devices"])]
    mean = statistics.fmean(per_share)
    devices = record["devices"]
    for i, (p, d) in enumerate(zip(profiles["devices"], devices)):
        nxt = devices[(i + 1) % len(devices)]
        link_ms = d["latency_ms"] + nxt["latency_ms"]  # one way, to the successor: both devices' links
        rows.append({"device": d["name"], "cpu_share": d["cpu"], "gflops": p["cpu_flops"] / 1e9,
                     "compute_vs_share": per_share[i] / mean - 1, "ram_available": p["ram_available"],
                     "memory_limit": d["memory_bytes"], "disk_mbps": p["disk_seq_read"] / 1e6,
                     "disk_limit_mbps": d["disk_mbps"], "hop_ms": p["link_latency_s"] * 1e3, "links_ms": link_ms,
                     "hop_error_ms": p["link_latency_s"] * 1e3 - link_ms,
                     "link_mbps": p["link_bandwidth"] * 8 / 1e6, "links_mbps": min(d["mbps"], nxt["mbps"])})
    return rows


def measure_plan(head: str, strategy: str, tokens: int, folder: Path, ctx: int = 0, raw: bool = False) -> dict:
    plan_file = folder / f"plan-{strategy}.json"
    ctl(head, "plan", "--strategy", strategy, "--out", str(plan_file), "--json", *(["--ctx", str(ctx)] if ctx else []))
    plan = json.loads(plan_file.read_text())
    if "infeasible" in plan:
        return {"strategy": strategy, "infeasible": plan["infeasible"]}
    started = time.perf_counter()
    ctl(head, "start", "--plan", str(plan_file))
    load_s = time.perf_counter() - started
    as_text = ["--raw"] if raw else []  # a synthetic store has no chat template; an instruct model ends a raw prompt
    ctl(head, "generate", "--max-tokens", "3", "--temperature", "0", "--speculate", "off", *as_text, "Hello")
    out = json.loads(ctl(head, "generate", "--max-tokens", str(tokens), "--temperature", "0", "--speculate", "off",
                         *as_text, "--json", PROMPT))
    status = json.loads(ctl(head, "status", "--json"))
    nodes = [{"address": r["address"], "name": r["name"], "windows": r["windows"], "predicted_ms": r["predicted_ms"],
              "measured_ms": r["measured_ms"], "rss_bytes": r["rss_bytes"], "disk_read_bytes": r["disk_read_bytes"]}
             for r in status["nodes"]]
    return {"strategy": strategy, "k": plan["k"], "windows": [d["window"] for d in plan["devices"]],
            "predicted_tpot_ms": plan["predicted_tpot_ms"], "measured_tpot_ms": out["tpot_ms"],
            "error": out["tpot_ms"] / plan["predicted_tpot_ms"] - 1, "tokens": out["tokens"], "load_s": load_s,
            "nodes": nodes}


async def _concurrent(head: str, n: int, tokens: int, raw: bool) -> tuple[int, float]:
    from prima_rpc.client import PrimaClient, Token

    async def one(i: int) -> int:
        got = 0
        async with PrimaClient(head) as client:
            async for event in client.generate(f"{PROMPT} ({i})", max_tokens=tokens, temperature=0.0,
                                               speculate="off", raw=raw):
                got += isinstance(event, Token)
        return got

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(counts), time.perf_counter() - started


def concurrency(head: str, levels: list[int], tokens: int, raw: bool = False) -> list[dict]:
    """Aggregate tokens/s of n requests at once, for 1 and each level, on the plan applied now."""
    rows = []
    for n in [1, *levels]:
        got, wall = asyncio.run(_concurrent(head, n, tokens, raw))
        rows.append({"requests": n, "tokens": got, "seconds": wall, "tokens_per_s": got / wall})
    for r in rows:
        r["vs_one"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def memory_peaks(base: int) -> list[dict]:
    from tools.testbed import cgroups

    state = bed.read_state(base)
    tree = cgroups.Tree.detect()
    return [{"device": d["name"]} | cgroups.DeviceGroups(tree, d["group"]).memory_usage() for d in state["devices"]]


def report(result: dict) -> None:
    print(f"{result['preset']}: {result['model']}")
    print(f"{'device':<7}{'share':>6}{'GFLOP/s':>9}{'vs share':>9}{'RAM MiB':>9}{'limit':>7}{'disk MB/s':>10}"
          f"{'set':>6}{'hop ms':>8}{'links':>7}{'Mbps':>7}{'set':>6}")
    for r in result["profiles"]:
        print(f"{r['device']:<7}{r['cpu_share']:>6.3f}{r['gflops']:>9.2f}{r['compute_vs_share']:>+9.1%}"
              f"{r['ram_available'] / 2**20:>9.0f}{r['memory_limit'] / 2**20:>7.0f}{r['disk_mbps']:>10.0f}"
              f"{r['disk_limit_mbps']:>6.0f}{r['hop_ms']:>8.2f}{r['links_ms']:>7.1f}{r['link_mbps']:>7.0f}"
              f"{r['links_mbps']:>6.0f}")
    print(f"\n{'strategy':<9}{'k':>3}  {'windows':<14}{'predicted':>10}{'measured':>10}{'error':>8}{'load s':>8}")
    for p in result["plans"]:
        if "infeasible" in p:
            print(f"{p['strategy']:<9} infeasible: {p['infeasible']}")
            continue
        print(f"{p['strategy']:<9}{p['k']:>3}  {','.join(map(str, p['windows'])):<14}{p['predicted_tpot_ms']:>10.1f}"
              f"{p['measured_tpot_ms']:>10.1f}{p['error']:>+8.1%}{p['load_s']:>8.1f}")
        for n in p["nodes"]:
            pm, mm = n["predicted_ms"], n["measured_ms"]
            print(f"    {n['name']:<6} windows {n['windows']}  predicted {pm or 0:.1f} ms  measured {mm or 0:.1f} ms"
                  f"  rss {n['rss_bytes'] / 2**20:.0f} MiB")
    for a, b in (("exo", "halda"), ("even", "halda")):
        pa = next((p for p in result["plans"] if p["strategy"] == a and "measured_tpot_ms" in p), None)
        pb = next((p for p in result["plans"] if p["strategy"] == b and "measured_tpot_ms" in p), None)
        if pa and pb:
            print(f"{a}/{b}: measured {pa['measured_tpot_ms'] / pb['measured_tpot_ms']:.2f}x, predicted "
                  f"{pa['predicted_tpot_ms'] / pb['predicted_tpot_ms']:.2f}x")
    same = len({tuple(p["tokens"]) for p in result["plans"] if "tokens" in p}) <= 1
    print(f"greedy tokens identical across plans: {same}")
    for r in result.get("concurrency", []):
        print(f"{r['requests']} at once: {r['tokens_per_s']:.2f} tokens/s in all ({r['vs_one']:.2f}x one)")
    for m in result.get("memory", []):
        print(f"{m['device']}: peak {m['peak'] / 2**20:.0f} MiB of {m['limit'] / 2**20:.0f} (page cache counted)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--strategies", nargs="+", default=["halda", "exo", "even"])
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--base-port", type=int, default=bed.DEFAULT_BASE)
    p.add_argument("--reuse", action="store_true", help="use the testbed already up on --base-port")
    p.add_argument("--keep", action="store_true", help="leave the testbed up")
    p.add_argument("--concurrent", type=int, nargs="*", default=[], help="also aggregate tokens/s of N requests at "
                   "once (and of one) on the first strategy's plan")
    p.add_argument("--no-prefetch", action="store_true", help="nodes load streamed layers on demand "
                   "($PRIMA_PREFETCH_DEPTH=0): the prefetch-off row")
    p.add_argument("--ctx", type=int, default=1024, help="the context the nodes keep KV room for and the plans price "
                   "(0: the model's own)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text (a store without a chat template)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    env = {"PRIMA_PREFETCH_DEPTH": "0"} if a.no_prefetch else {}
    if a.reuse and (state := bed.read_state(a.base_port)) is not None:
        record = bed.record(state)
    else:
        record = bed.up(load_home(a.preset), a.model.resolve(), base=a.base_port, node_env=env,
                        node_args=["--ctx", str(a.ctx)] if a.ctx else [])
    try:
        started = time.perf_counter()
        profiles, _ = profile_ring(record["head"], None, refresh=True)
        result = {"preset": a.preset, "model": str(a.model), "profile_s": time.perf_counter() - started,
                  "profiles": profile_check(record, profiles), "plans": []}
        with tempfile.TemporaryDirectory() as tmp:
            for s in a.strategies:
                result["plans"].append(measure_plan(record["head"], s, a.tokens, Path(tmp), a.ctx, a.raw))
                print(json.dumps({k: v for k, v in result["plans"][-1].items() if k != "nodes"}), file=sys.stderr)
            result["memory"] = memory_peaks(a.base_port)
            if a.concurrent:
                if len(a.strategies) > 1:
                    measure_plan(record["head"], a.strategies[0], 2, Path(tmp), a.ctx, a.raw)
                result["concurrency"] = concurrency(record["head"], a.concurrent, a.tokens, a.raw)
    finally:
        if not a.keep:
            bed.down(a.base_port, say=lambda line: None)
    print(json.dumps(result)) if a.json else report(result)


if __name__ == "__main__":
    main()
