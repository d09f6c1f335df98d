"""Ring overhead: TPOT and TTFT of local loopback rings vs the single-process reference (and prima.cpp's ring on
the same GGUF where a build exists), one run.

    python -m tools.bench.bench_ring [--tokens 64] [--store float32|int4|int8] [--dtype float32] [--repeats 3]
                                     [--prima-cpp DIR]

Every ring is real prima-node processes on 127.0.0.1. TPOT/TTFT come from the head's Finished event
(the same clock for every shape); the reference is timed the same way in a subprocess with the nodes'
environment (OpenMP's short spin, prima_rpc/__init__.py). Bytes per hop per token: the serialized
size of one decode frame times k (frames cross each hop k times a token). prima.cpp (tools/bench/prima_cpp.py):
the default model's Q4_1 GGUF, the same windows with -lw, 1 thread a rank, its own eval timer; built on demand
from --prima-cpp DIR (a source tree or bare git directory), else found in the cache, else a "no prima.cpp build"
line. Compare it with `--store int4`, which keeps that file's Q4_1 blocks. Each of its runs comes right after one
of ours on the same shape (a VM's speed drifts by 1.3x within minutes), and the ratio column is the median of
those pairs' ratios.
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams, Generation
from prima_rpc import codec
from prima_rpc.app import ring
from prima_rpc.app.local_ring import launch
from prima_rpc.client import Finished, PrimaClient
from prima_rpc.v1 import prima_pb2 as pb
from tools.bench import prima_cpp
from tools.default_model import default_gguf, ensure_default_store

PROMPT = "Write a short story about a robot who learns to paint."
SHAPES = {"1 node": [30], "3 nodes k=1": [10, 10, 10], "3 nodes k=2": [7, 3, 5], "4 nodes, 1 relay": [10, 10, 0, 10]}


def reference(store: Path, dtype: str, tokens: int, repeats: int) -> tuple[float, float, str]:
    from nodes.engine.dtype_choice import compute_dtype
    from prima_rpc.spec.manifest import read_manifest

    dtype = compute_dtype(read_manifest(store)[0].dtype, None) if dtype == "auto" else dtype
    model = ReferenceModel(store, dtype=getattr(torch, dtype))
    ids = model.codec.prompt_ids(PROMPT)
    ttfts, tpots = [], []
    for _ in range(repeats + 1):
        gen = Generation(ids, GenerateParams(max_tokens=tokens), model.codec, (), model.cfg.max_seq_len)
        cache = model.new_cache(gen.capacity)
        stamps, start = [], time.perf_counter()
        while not gen.done:
            i, pos = gen.pending()
            gen.accept(model.step(i, pos, cache))
            stamps.append(time.perf_counter())
        ttfts.append((stamps[0] - start) * 1e3)
        tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)
    return statistics.median(ttfts[1:]), statistics.median(tpots[1:]), dtype


async def ring_run(head: str, tokens: int) -> Finished:
    async with PrimaClient(head) as client:
        # The ring stops at EOS; this prompt's greedy answer runs past 96 tokens, and TPOT is per token anyway.
        done = None
        async for event in client.generate(PROMPT, max_tokens=tokens):
            if isinstance(event, Finished):
                done = event
        return done


def frame_bytes(hidden: int, dtype: str) -> int:
    x = torch.zeros(1, hidden, dtype=getattr(torch, dtype))
    return pb.Frame(request_id="0" * 32, kind=pb.FORWARD, start_pos=100, next_layer=10, capacity=200,
                    hidden=codec.encode(x)).ByteSize()


def prima_cpp_cli(where: Path | None, skip: bool) -> Path | None:
    """prima.cpp's llama-cli, or None, saying why."""
    if skip:
        return None
    try:
        return prima_cpp.find_llama_cli(where)
    except prima_cpp.PrimaCppMissing as exc:
        print(f"no prima.cpp build: {exc}")
        return None


def shape_rows(store: Path, name: str, windows: list[int], node_args: list[str], logs: Path, tokens: int,
               repeats: int, fb: int, cli: Path | None) -> list[tuple]:
    """Our ring of this shape (and prima.cpp's 3-rank ring of the same windows, each of its runs right after one
    of ours): rows (name, k, TTFT, TPOT, bytes/hop/token, ours / prima.cpp)."""
    local = launch(store, len(windows), log_dir=logs, extra_args=[node_args] * len(windows), detach=False)
    runs, theirs = [], []
    try:
        ring.start(local.addresses[0], windows)
        asyncio.run(ring_run(local.addresses[0], 4))  # warm-up
        for _ in range(repeats):
            runs.append(asyncio.run(ring_run(local.addresses[0], tokens)))
            if cli is not None and len(windows) == 3:
                theirs.append(prima_cpp.ring_tpot(cli, default_gguf(), windows, tokens))
    finally:
        local.stop()
    k = 30 // sum(windows)
    tpot = statistics.median(r.tpot_ms for r in runs)
    pairs = statistics.median(r.tpot_ms / t for r, t in zip(runs, theirs)) if theirs else float("nan")
    rows = [(f"{name} {windows}", k, statistics.median(r.ttft_ms for r in runs), tpot, k * fb, pairs)]
    if theirs:
        rows.append((f"prima.cpp {name} {windows}", k, float("nan"), statistics.median(theirs), 0, float("nan")))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--store", default="float32", choices=["float32", "int4", "int8"],
                   help="the default model's store (int4 keeps its GGUF's Q4_1 blocks, as prima.cpp runs it)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: float32 for the float32 store, the "
                                                 "nodes' own measured choice for int4/int8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prima-cpp", type=Path, default=None, metavar="DIR",
                   help="prima.cpp source tree, bare git directory or build (default: a build in the cache)")
    p.add_argument("--no-prima-cpp", action="store_true", help="skip the prima.cpp rows")
    p.add_argument("--reference-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    dtype = args.dtype or ("float32" if args.store == "float32" else "auto")
    store = ensure_default_store(dtype=None if args.store == "float32" else args.store)
    if args.reference_only:
        print(json.dumps(reference(store, dtype, args.tokens, args.repeats)))
        return
    out = subprocess.run([sys.executable, "-m", "tools.bench.bench_ring", "--reference-only", "--tokens",
                          str(args.tokens), "--store", args.store, "--dtype", dtype, "--repeats", str(args.repeats)],
                         capture_output=True, text=True, check=True).stdout
    ref_ttft, ref_tpot, used = json.loads(out.strip().splitlines()[-1])
    rows = [(f"reference (1 process, {used})", 1, ref_ttft, ref_tpot, 0, float("nan"))]
    fb = frame_bytes(576, used)
    node_args = [] if dtype == "auto" else ["--dtype", dtype]
    cli = prima_cpp_cli(args.prima_cpp, args.no_prima_cpp)
    with tempfile.TemporaryDirectory() as logs:
        for name, windows in SHAPES.items():
            rows += shape_rows(store, name, windows, node_args, Path(logs), args.tokens, args.repeats, fb, cli)
    print(f"SmolLM2-135M-Instruct {args.store} store, {args.tokens} tokens, median of {args.repeats}; "
          f"decode frame = {fb} bytes")
    print(f"{'shape':40} {'k':>2} {'TTFT ms':>8} {'TPOT ms':>8} {'TPOT / ref':>10} {'bytes/hop/token':>15} "
          f"{'TPOT / prima.cpp (pairs)':>24}")
    for name, k, ttft, tpot, b, pairs in rows:
        print(f"{name:40} {k:2d} {ttft:8.1f} {tpot:8.1f} {tpot / ref_tpot:10.2f} {b:15d} {pairs:24.2f}")


if __name__ == "__main__":
    main()
