"""Prefixes that outlive a restart, and prefixes shared by concurrent chats (issue 50).

    python -m tools.bench.bench_prefix_restart [--part restart|share|both] [--system-tokens 1500] [--repeats 2]
                                               [--chats 4] [--share-tokens 2048] [--json]

restart: a 3-node loopback ring of the default model (SmolLM2, windows 10/10/10) with a prefix folder of its own.
Each repeat (its own system prompt) runs turn 1, waits for every node's prefix files, restarts every process and
assigns the same plan, and times turn 2 (turn 1 + answer + question): from disk. Then it deletes the files,
restarts again and times the same turn 2 cold. Tokens must match; the figure is the ratio of the median TTFTs.

share: one SmolLM2 shard (every layer, one process) holds the KV of a `--share-tokens` system prompt in its prefix
cache, and `--chats` requests start from it (each its own question, then a few decode steps in one batch), once
with the prefix's pages shared copy-on-write and once copied into each request. Reported: the KV bytes held (the
requests' caches + the prefix cache, as the node accounts them) and the process's anonymous memory growth
(/proc/self/status RssAnon: the requests' own pages; the shared prefix lives in shmem). Greedy tokens must match.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from prima_rpc.app import ring
from prima_rpc.app.local_ring import wait_serving
from tests.rings import collect, local_ring
from tools.bench.bench_prefix import WINDOWS, turns
from tools.default_model import ensure_default_store


def _disk_bytes(head: str) -> list[int]:
    return [info.stats.prefix_disk_bytes for _, info in ring.walk(head)]


def _restart(local) -> str:
    local.stop()
    for i, address in enumerate(local.addresses):
        wait_serving(address, local.start_node(i), 120.0)
    ring.start(local.addresses[0], WINDOWS)
    return local.addresses[0]


def measure_restart(tokens: int, repeats: int, max_tokens: int = 8) -> dict:
    disk, cold, prompt = [], [], 0
    with tempfile.TemporaryDirectory() as logs, tempfile.TemporaryDirectory() as folder:
        args = [["--prefix-dir", folder]] * 3
        with local_ring(ensure_default_store(), 3, Path(logs), WINDOWS, extra_args=args) as local:
            for seed in range(repeats):
                first, second = turns(tokens, 1000 + seed)
                head = local.addresses[0]
                collect(head, first, max_tokens, raw=True, speculate="off")
                deadline = time.monotonic() + 60
                while not all(_disk_bytes(head)) and time.monotonic() < deadline:
                    time.sleep(0.2)
                head = _restart(local)
                from_disk, done = collect(head, second, max_tokens, raw=True, speculate="off")
                disk.append(done.ttft_ms)
                prompt = done.prompt_tokens
                for path in Path(folder).glob("*.kv"):
                    path.unlink()
                head = _restart(local)
                cold_tokens, done = collect(head, second, max_tokens, raw=True, speculate="off")
                cold.append(done.ttft_ms)
                assert from_disk == cold_tokens, "the prefix from disk changed the tokens"
    c, d = statistics.median(cold), statistics.median(disk)
    return {"prompt_tokens": prompt, "cold_ttft_ms": round(c, 1), "disk_ttft_ms": round(d, 1),
            "speedup": round(c / d, 2), "cold_all": cold, "disk_all": disk}


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _chats(shard, system: list[int], questions: list[list[int]], share: bool, steps: int) -> dict:
    """KV bytes held while `questions` run at once from the cached system prompt (shared or copied)."""
    from nodes.engine.prefix_cache import Prefix, PrefixCache

    shard.prefixes = PrefixCache(share=share)
    n = len(system)
    saver = shard.cache_for("system", 0, n + 1, n + 1, Prefix(save_key="sys", save_len=n, prefill=True))
    shard.compute(shard.embed(system + [0]), saver, 0, 0)
    shard.release("system")
    anon = _rss_anon()
    caches, tokens = [], []
    for i, q in enumerate(questions):
        cache = shard.cache_for(f"chat{i}", n, n + len(q) + steps, len(q), Prefix("sys", n, prefill=True))
        h, _ = shard.compute(shard.embed(q), cache, n, 0)
        caches.append(cache)
        tokens.append([int(shard.logits(h).argmax())])
    for step in range(steps - 1):  # the chats decode together, one batch a step
        hs, _ = shard.compute_batch([(shard.embed(t[-1:]), c, n + len(q) + step)
                                     for t, c, q in zip(tokens, caches, questions, strict=True)], 0)
        for t, h in zip(tokens, shard.last_logits(hs).argmax(-1).tolist(), strict=True):
            t.append(h)
    held = {"requests_kv_bytes": sum(c.nbytes() for c in caches), "prefix_kv_bytes": shard.prefixes.nbytes(),
            "rss_anon_growth_bytes": _rss_anon() - anon, "tokens": tokens}
    held["kv_bytes_held"] = held["requests_kv_bytes"] + held["prefix_kv_bytes"]
    for i in range(len(questions)):
        shard.release(f"chat{i}")
    shard.prefixes.clear()
    return held


@torch.inference_mode()
def measure_share(system_tokens: int, chats: int, steps: int = 8) -> dict:
    from nodes.engine.shard import Shard
    from nodes.engine.store import LayerStore
    from prima_rpc.spec.windows import Windows

    store = LayerStore(ensure_default_store())
    n_layers = store.config.n_layers
    shard = Shard(store, Windows(((0, n_layers),), n_layers, True), torch.float32)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(100, 40000, (system_tokens,), generator=g).tolist()
    questions = [torch.randint(100, 40000, (24 + 4 * i,), generator=g).tolist() for i in range(chats)]
    shared = _chats(shard, system, questions, True, steps)
    copied = _chats(shard, system, questions, False, steps)
    assert shared.pop("tokens") == copied.pop("tokens"), "sharing the prefix changed the tokens"
    return {"system_tokens": system_tokens, "chats": chats, "shared": shared, "copied": copied,
            "kv_ratio": round(copied["kv_bytes_held"] / shared["kv_bytes_held"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["restart", "share", "both"], default="both")
    parser.add_argument("--system-tokens", type=int, default=1500, help="restart: the system prompt's size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--share-tokens", type=int, default=2048, help="share: the system prompt's tokens")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {}
    if args.part in ("share", "both"):
        result["share"] = measure_share(args.share_tokens, args.chats)
    if args.part in ("restart", "both"):
        result["restart"] = measure_restart(args.system_tokens, args.repeats)
    if args.json:
        print(json.dumps(result))
        return
    if "share" in result:
        s = result["share"]
        print(f"{s['chats']} chats on one {s['system_tokens']}-token system prompt: KV held "
              f"{s['shared']['kv_bytes_held'] / 2**20:.1f} MiB shared vs {s['copied']['kv_bytes_held'] / 2**20:.1f} "
              f"MiB copied ({s['kv_ratio']}x); anonymous memory grew {s['shared']['rss_anon_growth_bytes'] / 2**20:.1f}"
              f" vs {s['copied']['rss_anon_growth_bytes'] / 2**20:.1f} MiB")
    if "restart" in result:
        r = result["restart"]
        print(f"next turn of {r['prompt_tokens']} prompt tokens after the whole ring restarted: TTFT cold "
              f"{r['cold_ttft_ms']} ms, prefixes on disk {r['disk_ttft_ms']} ms ({r['speedup']}x lower)")


if __name__ == "__main__":
    main()
