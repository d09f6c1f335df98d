"""A decode step through a run of consecutive resident layers as one C call (ops.c's prima_window) where each layer
would take layer_calls' two: per layer, its attention_block, silu_mul and down_block, the very steps of the two calls
in their order, so the same bits (tests/test_layer_calls.py). What it saves is the Python between layers (fits,
bind, marshalling ~25 arguments, the activation, a Segment and a rope per layer): a layer's static arguments are
bound once per run (held on its first layer) and a request's KV pointers once per run (held on its cache)."""

import ctypes
from dataclasses import dataclass
from operator import is_

import torch

from nodes.engine import layer_calls
from nodes.engine.kernels import ops
from nodes.engine.quant import FEW_ROWS
from nodes.engine.row_attention import ROW_ATTENTION


@dataclass(frozen=True)
class Run:
    """Layers [start, stop) as prima_window takes them, and what they were bound from: used while the layers, their
    layer_calls.bind() results and the rope are those very objects."""

    layers: tuple  # the Layer objects
    bounds: tuple  # each one's layer_calls.Bound
    rope: object  # the Rope whose layer(i) tables the array points at
    args: ctypes.Array | None  # ops.LayerArgs [stop - start]; None: some layer does not take the C calls


@dataclass(frozen=True)
class RunKV:
    """A request's KV tensors of layers [start, stop) as prima_window takes them (one ops.KV each)."""

    tensors: tuple  # cache.kv[i], which the array points into
    array: ctypes.Array
    cap: int  # the fewest positions of any of them (a local layer's ring)


def forward(x: torch.Tensor, layers: dict, start: int, stop: int, spans: list, cfg, rope) -> torch.Tensor | None:
    """Hidden rows x [T, H] after layers [start, stop) of `layers`, as model.layer_forward computes them one by one,
    for spans [(cache: KVCache, pos, t)] in row order; None where the call does not apply (a layer not in `layers`,
    not float32 rows, more than FEW_ROWS of them, an activation other than silu, a segment past a cache or longer
    than ROW_ATTENTION, a layer whose matrices are not our kernels' or with a mixture of experts): the caller then
    runs the layers one by one."""
    if not (x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= FEW_ROWS and x.is_contiguous()
            and cfg.arch.act == "silu" and ops.available()):
        return None
    run = _bound(layers, start, stop, rope)
    if run is None or run.args is None:
        return None
    kvs = [_kv(cache, start, stop) for cache, _, _ in spans]
    if not all(kv is not None and t <= ROW_ATTENTION and pos + t <= kv.cap
               for (_, pos, t), kv in zip(spans, kvs, strict=True)):
        return None
    flat = [n for _, pos, t in spans for n in (pos, t)]
    return ops.window(x, run.args, (ctypes.c_int64 * len(flat))(*flat),
                      (ctypes.c_void_p * len(kvs))(*(ctypes.addressof(kv.array) for kv in kvs)), len(kvs),
                      cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, (cfg.query_scale or cfg.head_dim) ** -0.5,
                      cfg.norm_eps)


def _bound(layers: dict, start: int, stop: int, rope) -> Run | None:
    """The run's bound layers, bound again where a layer, its weights or the rope changed; None: not all resident."""
    held = tuple(map(layers.get, range(start, stop)))
    if None in held:
        return None
    run = held[0].runs.get(stop)
    if (run is not None and run.rope is rope and all(map(is_, run.layers, held))
            and all(map(is_, run.bounds, map(layer_calls.bind, held)))):
        return run
    bounds = tuple(map(layer_calls.bind, held))
    ropes = [rope.layer(i) for i in range(start, stop)]
    usable = all(b.matrices is not None and lay.moe is None and ops.fits(r.cos, r.sin)
                 for lay, b, r in zip(held, bounds, ropes, strict=True))
    args = (ops.LayerArgs * len(held))(*(_args(b, r) for b, r in zip(bounds, ropes, strict=True))) if usable else None
    held[0].runs[stop] = run = Run(held, bounds, rope, args)
    return run


def _args(bound: layer_calls.Bound, rope) -> ops.LayerArgs:
    return ops.LayerArgs(*bound.matrices, *(p or None for p in bound.norms), rope.cos.data_ptr(), rope.sin.data_ptr(),
                         rope.cos.shape[1], rope.window or 0)


def _kv(cache, start: int, stop: int) -> RunKV | None:
    """The cache's KV array of layers [start, stop), built at its first use (its tensors are fixed for a request);
    None where ops.c does not take them (not float32)."""
    tensors = tuple(map(cache.kv.__getitem__, range(start, stop)))
    kv = cache.runs.get((start, stop))
    if kv is None or not all(map(is_, kv.tensors, tensors)):
        if not all(ops.fits(t) for t in tensors):
            return None
        array = (ops.KV * len(tensors))(*((t.data_ptr(), t.shape[2]) for t in tensors))
        cache.runs[(start, stop)] = kv = RunKV(tensors, array, min(t.shape[2] for t in tensors))
    return kv
