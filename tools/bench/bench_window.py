"""A decode step through a run of resident layers: one window call (window_calls) against the per-layer C path
(layer_calls' two calls a layer, ops.c's silu between) and against that path with torch's silu (as before
session 25), interleaved step by step on one Shard at one thread, so that a shared machine's drift falls on all
three alike.

    python -m tools.bench.bench_window [--store int4] [--layers 10] [--steps 400] [--repeats 3]

Each row: the median of --repeats runs of the median step (us), and its ratio to the window call's.
"""

import argparse
import statistics
import time

import torch

from nodes.engine import activation, layer_calls, window_calls
from tools.bench.markdown import table


def torch_gated(gu: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return activation.ACTIVATIONS[act](gate) * up


def per_layer(*args):
    return None


PATHS = {  # name -> (window_calls.forward, activation.gated) while it runs
    "window call": (window_calls.forward, activation.gated),
    "per layer (2 C calls, C silu)": (per_layer, activation.gated),
    "per layer (2 C calls, torch silu)": (per_layer, torch_gated),
}


def run(shard, steps: int) -> dict[str, float]:
    """Median us a step for each path over positions 0 .. steps - 1, the paths in turn at each position."""
    caches = {name: shard.cache_for(name, 0, steps + 1, 1) for name in PATHS}
    x0 = torch.randn(1, shard.cfg.hidden) * 0.1
    took = {name: [] for name in PATHS}
    for pos in range(steps):
        order = list(PATHS) if pos % 2 else list(reversed(PATHS))
        for name in order:
            forward, gated = PATHS[name]
            window_calls.forward, layer_calls.gated = forward, gated
            start = time.perf_counter()
            shard.compute(x0, caches[name], pos, 0)
            took[name].append(time.perf_counter() - start)
    window_calls.forward, layer_calls.gated = PATHS["window call"]
    for name in PATHS:
        shard.release(name)
    return {name: statistics.median(t[steps // 10:]) * 1e6 for name, t in took.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="int4", help="the default model's store: int4, float32")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    from nodes.engine.shard import Shard
    from nodes.engine.store import LayerStore
    from prima_rpc.spec.windows import Windows
    from tools.default_model import ensure_default_store

    torch.set_num_threads(1)
    store = LayerStore(ensure_default_store(dtype=None if a.store == "float32" else a.store))
    shard = Shard(store, Windows(((0, a.layers),), store.config.n_layers, False), torch.float32)
    runs = [run(shard, a.steps) for _ in range(a.repeats)]
    us = {name: statistics.median(r[name] for r in runs) for name in PATHS}
    print(f"{store.model_id[:12]} {a.store}, layers [0, {a.layers}), one row, {a.steps} positions, "
          f"torch {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    print(table(["path", "us a step", "x window call"],
                [[name, f"{v:.0f}", f"{v / us['window call']:.2f}"] for name, v in us.items()], right=(1, 2)))


if __name__ == "__main__":
    main()
