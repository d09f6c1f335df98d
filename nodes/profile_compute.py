"""Calibrate the profile's compute rates on the node's own path: decode steps through a Shard of the store.

One decoder layer timed alone (how the profiler first calibrated) ran faster than the same layers in a ring node
(SmolLM2 here: 0.8 vs 1.0 ms a layer, and predicted TPOTs 20-30 % low). A node runs its window through
nodes.shard.Shard: one layer after another, each with its own weights, a KV cache of the reserve's
capacity, a growing context, each step after the rest of the ring's work. This times exactly that on the
store's first layers (as many as SWEEP_BYTES hold, at least one, so their weights come from memory, not
cache) and reports per-layer rates.
"""

import statistics
import time
from pathlib import Path

import torch

from nodes.fused import layer_bytes
from nodes.prefetch import KV_RESERVE_TOKENS
from nodes.routing import Windows
from nodes.shapes import layer_flops
from nodes.shard import Shard
from nodes.store import LayerStore

BUDGET_S = 0.5
WARM_UP = 4
SWEEP_BYTES = 256 << 20
QUIET_S = 0.02  # each step after a quiet gap: the ring comes back to a node after the others' work


def measure_node_layers(store_dir: Path, dtype: str) -> dict | None:
    """{"layer_s", "flops_rate", "bytes_rate", "layers"} of one decode step per layer through a node's
    Shard, or None for a store without weights."""
    store = LayerStore(store_dir)
    if store.manifest.manifest_only:
        return None
    cfg, torch_dtype = store.config, getattr(torch, dtype)
    nbytes = layer_bytes(cfg, torch_dtype)
    n = max(1, min(cfg.n_layers, SWEEP_BYTES // nbytes))
    shard = Shard(store, Windows(((0, n),), cfg.n_layers, False), torch_dtype, budget=0, depth=0)
    try:
        cache = shard.cache_for("profile", 0, min(KV_RESERVE_TOKENS, cfg.max_seq_len), 1)
        x = torch.randn(1, cfg.hidden).to(torch_dtype)
        times: list[float] = []
        deadline = time.perf_counter() + BUDGET_S
        for pos in range(cache.capacity):  # one token after another, as a request decodes
            time.sleep(QUIET_S)  # back to back ran up to 1.6x faster than a ring's node while others ran
            start = time.perf_counter()
            shard.compute(x, cache, pos, 0)
            if pos >= WARM_UP:
                times.append(time.perf_counter() - start)
            if len(times) >= 5 and time.perf_counter() > deadline:
                break
    finally:
        shard.close()
    layer_s = statistics.median(times) / n
    return {"layer_s": layer_s, "flops_rate": layer_flops(cfg) / layer_s, "bytes_rate": nbytes / layer_s,
            "layers": n}
