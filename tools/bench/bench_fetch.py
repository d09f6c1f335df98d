"""Weights over the ring: transfer rate between two loopback nodes vs a plain file copy, and the time from
empty-cache `prima-node` processes to the first token of a 3-node ring vs nodes that all have the model.

    flock -x /tmp/prima-cpu.lock python -m tools.bench.bench_fetch [--repeats 3]

The transfer: one prima-node serves the SmolLM2 store; a Fetcher in this process fetches every unit into an
empty temporary cache (chunked gRPC stream, sha256 of every file, .part then rename). The copy: shutil.copyfile
of the same files into another directory of the same disk. Both read the store from the page cache (warmed
first). The first token: launch 3 processes, `ring.start` [10, 10, 10], one greedy token; wall clock.
"""

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from nodes.engine.store import LayerStore
from nodes.ring.fetch import Fetcher
from prima_rpc.app import ring
from prima_rpc.app.local_ring import launch
from prima_rpc.client import PrimaClient, Token
from tools.default_model import ensure_default_store


def fetch_all(address: str, store: LayerStore, cache: Path) -> tuple[float, int]:
    async def run():
        fetcher = Fetcher(cache, store.model_id, [address], None)
        start = time.perf_counter()
        try:
            await fetcher.store(list(store.manifest.units()), head=True)
        finally:
            await fetcher.close()
        return time.perf_counter() - start, fetcher.fetched

    return asyncio.run(run())


def copy_all(store: LayerStore, dest: Path) -> tuple[float, int]:
    start, n = time.perf_counter(), 0
    for entry in store.manifest.units().values():
        shutil.copyfile(store.root / entry.path, dest / Path(entry.path).name)
        n += entry.bytes
    return time.perf_counter() - start, n


def first_token(models: list[Path | None], work: Path) -> float:
    start = time.perf_counter()
    local = launch(None, 3, log_dir=work, detach=False, models=models,
                   extra_args=[["--cache", str(work / f"cache{i}")] for i in range(3)])
    try:
        ring.start(local.addresses[0], [10, 10, 10])

        async def one():
            async with PrimaClient(local.addresses[0]) as client:
                async for event in client.generate("Hello", max_tokens=1):
                    if isinstance(event, Token):
                        return

        asyncio.run(one())
        return time.perf_counter() - start
    finally:
        local.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    root = ensure_default_store()
    store = LayerStore(root)
    copy_all(store, Path(tempfile.mkdtemp()))  # warm the page cache for both sides
    fetch_s, copy_s, rates = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        server = launch(root, 1, log_dir=Path(tmp), detach=False)
        try:
            for r in range(args.repeats):
                secs, n = fetch_all(server.addresses[0], store, Path(tmp) / f"fetch{r}")
                fetch_s.append(secs)
                (Path(tmp) / f"copy{r}").mkdir()
                secs, n_copy = copy_all(store, Path(tmp) / f"copy{r}")
                copy_s.append(secs)
                shutil.rmtree(Path(tmp) / f"fetch{r}")
                shutil.rmtree(Path(tmp) / f"copy{r}")
        finally:
            server.stop()
        rates["fetch_MiB_s"] = n / statistics.median(fetch_s) / 2**20
        rates["copy_MiB_s"] = n_copy / statistics.median(copy_s) / 2**20
        rates["fetch_vs_copy"] = rates["fetch_MiB_s"] / rates["copy_MiB_s"]
        empty, full = [], []
        for r in range(args.repeats):
            empty.append(first_token([root, None, None], Path(tmp) / f"empty{r}"))
            full.append(first_token([root, root, root], Path(tmp) / f"full{r}"))
    print(json.dumps({"store_bytes": n, "repeats": args.repeats, **{k: round(v, 2) for k, v in rates.items()},
                      "first_token_empty_cache_s": round(statistics.median(empty), 2),
                      "first_token_all_have_model_s": round(statistics.median(full), 2),
                      "empty_vs_full": round(statistics.median(empty) / statistics.median(full), 2)}, indent=1))


if __name__ == "__main__":
    main()
