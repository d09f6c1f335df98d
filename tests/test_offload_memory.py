"""Disk offload measured: peak RSS of a streaming shard within its budget, and a real ring of one-layer budgets
(stream buffers as a plan gives them) equal to the reference, each node's RSS within its budget."""

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
import torch

from nodes.engine.fused import head_bytes, layer_bytes
from nodes.engine.memory_plan import aligned
from nodes.engine.store import LayerStore
from prima_rpc.app import ring
from prima_rpc.client import PrimaError
from tests.rings import collect, greedy_reference, local_ring
from tests.subprocesses import run_python

pytestmark = pytest.mark.slow
MB = 1 << 20

RSS_SCRIPT = r"""
import json, sys, threading, time
import psutil, torch
from prima_rpc.spec.windows import Windows
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore

store_dir, budget, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
proc = psutil.Process()
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's lazy start-up belongs to the baseline
baseline = proc.memory_info().rss
peak, done = baseline, threading.Event()

def sample():
    global peak
    while not done.is_set():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.002)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
store = LayerStore(store_dir)
n = store.config.n_layers
shard = Shard(store, Windows(((0, n),), n, True), torch.float32, budget=budget)
ids, pos = [1, 2, 3, 4, 5, 6, 7, 8], 0
cache = shard.cache_for("r", 0, len(ids) + steps, len(ids))
for _ in range(steps):
    h, _ = shard.compute(shard.embed(ids), cache, pos, 0)
    pos, ids = pos + len(ids), [int(shard.logits(h).argmax())]
done.set()
sampler.join()
print(json.dumps({"baseline": baseline, "peak": peak, "end": proc.memory_info().rss, "budget": shard.plan.budget,
                  "streamed": len(shard.plan.streamed), "share": n * shard.plan.layer_bytes,
                  "resident_bytes": shard.resident_bytes(), "staging": store.staging_bytes}))
"""
RSS_OVERHEAD = 32 * MB  # read staging (16 MiB), rope tables, activations, allocator slack
NODE_OVERHEAD = 48 * MB  # the same, plus what a node's first request adds (gRPC buffers, torch's thread pools)
TOKENIZER_OVERHEAD = 48 * MB  # the head also holds the tokenizer (about 33 MiB for SmolLM2's)


def test_peak_rss_stays_within_budget(smol_store):
    cfg = LayerStore(smol_store).config
    budget = head_bytes(cfg, torch.float32) + 40 * MB + 6 * layer_bytes(cfg, torch.float32)
    out = run_python(RSS_SCRIPT, str(smol_store), str(budget), "6")
    r = json.loads(out.strip().splitlines()[-1])
    assert r["budget"] == budget and r["streamed"] > 20  # most of the 30 layers stream
    growth = r["peak"] - r["baseline"]
    assert growth <= budget + RSS_OVERHEAD, f"peak RSS grew {growth / MB:.0f} MiB for a {budget / MB:.0f} MiB budget"
    assert r["resident_bytes"] <= budget


@contextmanager
def peak_rss(processes: list[subprocess.Popen], floor: list[int]) -> Iterator[list[int]]:
    """Each process's highest RSS (from `floor`) while the block runs, sampled every 5 ms."""
    procs = [psutil.Process(p.pid) for p in processes]
    peaks, done = list(floor), threading.Event()

    def sample():
        while not done.is_set():
            for i, p in enumerate(procs):
                peaks[i] = max(peaks[i], p.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peaks
    finally:
        done.set()
        sampler.join()


def test_ring_under_one_layer_budgets_equals_the_reference(smol_store, tmp_path):
    prompts, tokens = ["What is the capital of France?", "List three prime numbers."], 8
    reference = greedy_reference(smol_store, prompts, tokens)
    with local_ring(smol_store, 3, tmp_path, extra_args=[["--mem-budget", "1"]] * 3) as local:
        head = local.addresses[0]
        # started, nothing loaded: the runtime's own footprint
        idle = [psutil.Process(p.pid).memory_info().rss for p in local.processes]
        # k = 3: each node's share is split across rounds; stream buffers as a plan gives them (in layers)
        nodes = ring.start(head, [3, 5, 2], buffers=[1.5, 1.0, 2.5])
        with peak_rss(local.processes, idle) as peaks:
            for prompt in prompts:
                assert collect(head, prompt, tokens)[0] == reference[prompt], prompt
        after = ring.walk(head)
        # a node whose window fits its buffer reads it all in its gaps and never waits; the others do
        assert any(info.stats.stall_s > 0 for _, info in after)
        for (_, start), (_, info), base, peak in zip(nodes, after, idle, peaks):
            s = info.stats
            assert s.resident_bytes <= info.mem_budget and info.mem_budget > 1  # raised to the minimum
            overhead = NODE_OVERHEAD + (TOKENIZER_OVERHEAD if info.role == "head" else 0)
            assert peak - base <= info.mem_budget + overhead, (
                f"{info.name}: RSS grew {(peak - base) / MB:.0f} MiB, budget {info.mem_budget / MB:.0f} MiB")
            assert s.disk_read_bytes - start.stats.disk_read_bytes >= 2 * tokens * 5 * 14 * MB // 2
            assert s.compute_s > 0
        # more KV positions than the budgets keep room for: a clear error, not an overrun
        with pytest.raises(PrimaError, match="leaves room for .* KV positions.*--mem-budget"):
            collect(head, prompts[0], 4000)
        assert collect(head, prompts[1], tokens)[0] == reference[prompts[1]]  # and the ring serves on
    logs = "".join(p.read_text() for p in tmp_path.glob("node*.log"))
    assert "offload plan" in logs and "offload stats" in logs
    layer = layer_bytes(LayerStore(smol_store).config, torch.float32)
    for buffer in (int(1.5 * layer), layer, int(2.5 * layer)):  # each node took its buffer
        assert f"buffer={aligned(buffer)}" in logs
