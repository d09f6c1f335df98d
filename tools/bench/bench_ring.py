"""Ring overhead: TPOT and TTFT of local loopback rings vs the single-process reference, one run.

    python -m tools.bench.bench_ring [--tokens 64] [--dtype float32] [--repeats 3]

Every ring is real prima-node processes on 127.0.0.1. TPOT/TTFT come from the head's Finished event
(the same clock for every shape); the reference is timed the same way in a subprocess with the nodes'
environment (OpenMP's short spin, prima_rpc/__init__.py). Bytes per hop per token: the serialized
size of one decode frame times k (frames cross each hop k times a token).
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
from tools.default_model import ensure_default_store

PROMPT = "Write a short story about a robot who learns to paint."
SHAPES = {"1 node": [30], "3 nodes k=1": [10, 10, 10], "3 nodes k=2": [7, 3, 5], "4 nodes, 1 relay": [10, 10, 0, 10]}


def reference(store: Path, dtype: str, tokens: int, repeats: int) -> tuple[float, float]:
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
    return statistics.median(ttfts[1:]), statistics.median(tpots[1:])


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reference-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    store = ensure_default_store()
    if args.reference_only:
        print(json.dumps(reference(store, args.dtype, args.tokens, args.repeats)))
        return
    out = subprocess.run([sys.executable, "-m", "tools.bench.bench_ring", "--reference-only", "--tokens",
                          str(args.tokens), "--dtype", args.dtype, "--repeats", str(args.repeats)],
                         capture_output=True, text=True, check=True).stdout
    ref_ttft, ref_tpot = json.loads(out.strip().splitlines()[-1])
    rows = [("reference (1 process)", 1, ref_ttft, ref_tpot, 0)]
    fb = frame_bytes(576, args.dtype)
    with tempfile.TemporaryDirectory() as logs:
        for name, windows in SHAPES.items():
            local = launch(store, len(windows), log_dir=Path(logs), extra_args=[["--dtype", args.dtype]] * len(windows),
                           detach=False)
            try:
                ring.start(local.addresses[0], windows)
                asyncio.run(ring_run(local.addresses[0], 4))  # warm-up
                runs = [asyncio.run(ring_run(local.addresses[0], args.tokens)) for _ in range(args.repeats)]
            finally:
                local.stop()
            k = 30 // sum(windows)
            rows.append((f"{name} {windows}", k, statistics.median(r.ttft_ms for r in runs),
                         statistics.median(r.tpot_ms for r in runs), k * fb))
    print(f"SmolLM2-135M-Instruct {args.dtype}, {args.tokens} tokens, median of {args.repeats}; "
          f"decode frame = {fb} bytes")
    print(f"{'shape':34} {'k':>2} {'TTFT ms':>8} {'TPOT ms':>8} {'TPOT / ref':>10} {'bytes/hop/token':>15}")
    for name, k, ttft, tpot, b in rows:
        print(f"{name:34} {k:2d} {ttft:8.1f} {tpot:8.1f} {tpot / ref_tpot:10.2f} {b:15d}")


if __name__ == "__main__":
    main()
