"""Calibrate the profile with the model itself: time one real decoder layer of the store in decode.

The roofline figures (GEMV rate, memory bandwidth) miss what a real layer costs here: several
kernels, norms, RoPE, attention and Python between them. The effective rates from one layer of the
store make the cost model predict this device's decode time per layer exactly.
"""

import statistics
import time
from pathlib import Path

import torch

from nodes.model import KVCache, Layer, Rope, layer_forward
from nodes.shapes import layer_flops
from nodes.store import LayerStore

POSITION = 128  # a typical decode position: attention over a short context
BUDGET_S = 0.5
SWEEP_BYTES = 256 << 20  # cycle through copies of the layer so its weights come from memory, not cache


def measure_decode_layer(store_dir: Path, dtype: str) -> dict | None:
    """{"layer_s", "flops_rate", "bytes_rate"} for one decode step of layer 0, or None if no weights (bytes:
    the layer's real ones, packed when quantized)."""
    store = LayerStore(store_dir)
    if store.manifest.manifest_only:
        return None
    cfg, torch_dtype, fmt = store.config, getattr(torch, dtype), store.manifest.weight_format()
    unit = store.load("layer.0")
    first = Layer.from_unit(unit, torch_dtype, fmt)  # quantized stores: the int4/int8 kernels' own rate
    copies = max(1, min(64, SWEEP_BYTES // first.nbytes()))
    layers = [first] + [Layer.from_unit({k: v.clone() for k, v in unit.items()}, torch_dtype, fmt)
                        for _ in range(copies - 1)]
    cache = KVCache([0], cfg, POSITION + 1, torch_dtype)
    rope = Rope(cfg, POSITION + 1, torch_dtype)
    x = torch.randn(1, cfg.hidden).to(torch_dtype)
    times: list[float] = []
    with torch.inference_mode():
        for layer in layers:  # warm-up
            layer_forward(x, layer, cache.kv[0], POSITION, cfg, rope)
        deadline = time.perf_counter() + BUDGET_S
        while time.perf_counter() < deadline or len(times) < 5:
            start = time.perf_counter()
            for layer in layers:
                layer_forward(x, layer, cache.kv[0], POSITION, cfg, rope)
            times.append((time.perf_counter() - start) / len(layers))
    layer_s = statistics.median(times)
    return {"layer_s": layer_s, "flops_rate": layer_flops(cfg) / layer_s,
            "bytes_rate": first.nbytes() / layer_s}
