"""A decoder layer's fused buffers, allocated once, and where each tensor of a unit file goes inside them."""

from collections.abc import Iterable

import torch

from nodes.engine.formats import PARTS, Format, Piece
from nodes.engine.kv_dtype import FLOAT, KVDtype
from nodes.engine.model import SMALL, Layer, Weight, window_slots
from nodes.engine.quant import Rows
from prima_rpc.spec.manifest import ModelConfig
from prima_rpc.spec.shapes import (
    FUSED,
    expert_matrix_shapes,
    expert_shapes,
    fused_rows,
    layer_params,
    layer_shapes,
    matrix_params,
    matrix_shapes,
)


def empty_layer(cfg: ModelConfig, dtype: torch.dtype) -> Layer:
    """A Layer of uninitialised tensors with the shapes `Layer.from_unit` makes (64-byte aligned, like it)."""
    matrices = {unit: torch.empty(shape, dtype=dtype) for unit, shape in matrix_shapes(cfg).items()}
    return Layer(**empty_small(cfg, dtype), **matrices)


def layer_targets(layer: Layer, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Unit tensor name -> the (contiguous) part of `layer` it fills; from_unit's torch.cat, without the copy."""
    out = small_targets(layer.small(), cfg)
    for unit in STREAM_UNITS:
        out.update(unit_targets(unit, getattr(layer, unit), cfg))
    return out


STREAM_UNITS = tuple(FUSED)  # a layer's matrices: the units of residency and streaming


def unit_targets(unit: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Unit file tensor name -> its part of the fused matrix `t` (one of STREAM_UNITS)."""
    return {name: t[rows] for name, rows in fused_rows(unit, cfg).items()}


def stream_parts(unit: str, cfg: ModelConfig, fmt: Format | None,
                 dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors (dtype, shape) that hold one of STREAM_UNITS in memory: one fused float matrix, or a
    quantized one's two stored tensors per piece (Format.pieces; named as in the unit file)."""
    if fmt is None:
        return {unit: (dtype, matrix_shapes(cfg)[unit])}
    return {f"{p.name}.{part}": spec for p, shape in piece_shapes(unit, fmt, layer_shapes(cfg))
            for part, spec in p.fmt.parts(shape).items()}


def piece_shapes(unit: str, fmt: Format, shapes: dict[str, tuple[int, ...]]) -> list[tuple[Piece, tuple[int, int]]]:
    """The pieces of the fused matrix `unit` in `fmt` (Format.pieces) and their shapes, of a unit of tensor `shapes`
    (shapes.layer_shapes, expert_shapes)."""
    return [(p, (sum(shapes[f"{q}.weight"][0] for q in p.parts), shapes[f"{p.parts[0]}.weight"][1]))
            for p in fmt.pieces(unit)]


def part_targets(unit: str, parts: dict[str, torch.Tensor], cfg: ModelConfig,
                 fmt: Format | None) -> dict[str, torch.Tensor]:
    """Unit file tensor name -> where it goes among `parts` (stream_parts' tensors)."""
    return unit_targets(unit, parts[unit], cfg) if fmt is None else dict(parts)


def part_weight(unit: str, parts: dict[str, torch.Tensor], fmt: Format | None, dtype: torch.dtype) -> Weight:
    """The matrix that `parts` hold, ready for linear()."""
    if fmt is None:
        return parts[unit]
    pieces = [p.fmt.weight(parts[f"{p.name}.qweight"], parts[f"{p.name}.scales"], dtype) for p in fmt.pieces(unit)]
    return pieces[0] if len(pieces) == 1 else Rows(pieces)


def empty_parts(unit: str, cfg: ModelConfig, fmt: Format | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, dtype=dt) for name, (dt, shape) in stream_parts(unit, cfg, fmt, dtype).items()}


def matrix_bytes(shape: tuple[int, int], fmt: Format | None, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize if fmt is None else fmt.nbytes(shape)


def fused_bytes(unit: str, shapes: dict[str, tuple[int, ...]], fmt: Format | None, dtype: torch.dtype) -> int:
    """Memory of the fused matrix `unit` of a unit of tensor `shapes`, each piece in its format (Format.pieces)."""
    if fmt is None:
        return sum(matrix_bytes(shapes[f"{p}.weight"], None, dtype) for p in PARTS[unit])
    return sum(p.fmt.nbytes(shape) for p, shape in piece_shapes(unit, fmt, shapes))


def empty_small(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    """A layer's SMALL tensors, uninitialised (None where the architecture has none)."""
    q, kv, shapes = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, layer_shapes(cfg)
    small = {n: torch.empty(shapes[f"{n}.weight"], dtype=dtype) if f"{n}.weight" in shapes else None for n in SMALL}
    small["bqkv"] = torch.empty(q + 2 * kv, dtype=dtype) if cfg.qkv_bias else None
    return small


def small_targets(small: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Unit file tensor name -> its part of a layer's small tensors (SMALL; bqkv may be None)."""
    out = {f"{n}.weight": t for n, t in small.items() if n != "bqkv" and t is not None}
    b = small.get("bqkv")
    if b is not None:
        out.update({name: b[rows] for name, rows in fused_rows("wqkv", cfg, "bias").items()})
    return out


def layer_bytes(cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None = None) -> int:
    """Memory of one fused layer computing in `dtype` (matrices in `fmt` when quantized)."""
    small = (layer_params(cfg) - matrix_params(cfg)) * dtype.itemsize  # norms and biases (and a mixture's router)
    matrices = sum(fused_bytes(u, layer_shapes(cfg), fmt, dtype) for u in matrix_shapes(cfg))
    return small + matrices + cfg.n_experts * expert_bytes(cfg, dtype, fmt)


def expert_bytes(cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None = None) -> int:
    """Memory of one expert of a mixture (0: a dense model)."""
    return sum(fused_bytes(u, expert_shapes(cfg), fmt, dtype) for u in expert_matrix_shapes(cfg)) if cfg.moe else 0


def head_bytes(cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None = None) -> int:
    """Memory of the head's embedding, final norm and (untied) output projection."""
    matrix = matrix_bytes((cfg.vocab, cfg.hidden), fmt, dtype)
    return matrix * (1 if cfg.tie_embeddings else 2) + cfg.hidden * dtype.itemsize


def kv_bytes(cfg: ModelConfig, dtype: torch.dtype, layers: int | Iterable[int], tokens: int,
             kv_dtype: KVDtype = FLOAT) -> int:
    """KV cache memory of one request of `tokens` positions over `layers` (indices, or a count: the first that many),
    as KVCache holds it in `kv_dtype`: a sliding-window layer keeps a ring of window_slots positions when that is
    fewer."""
    layers = range(layers) if isinstance(layers, int) else layers
    ring = window_slots(cfg)
    local = frozenset(cfg.local_layers) if ring < tokens else frozenset()
    positions = sum(ring if i in local else tokens for i in layers)
    return kv_dtype.bytes_per_token(cfg.n_kv_heads, cfg.head_dim, dtype) * positions
