"""A decoder layer's fused buffers, allocated once, and where each tensor of a unit file goes inside them."""

import torch

from nodes.config import ModelConfig
from nodes.model import Layer


def empty_layer(cfg: ModelConfig, dtype: torch.dtype) -> Layer:
    """A Layer of uninitialised tensors with the shapes `Layer.from_unit` makes (64-byte aligned, like it)."""
    h, q, kv, i = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate
    return Layer(
        attn_norm=torch.empty(h, dtype=dtype),
        wqkv=torch.empty(q + 2 * kv, h, dtype=dtype),
        bqkv=torch.empty(q + 2 * kv, dtype=dtype) if cfg.qkv_bias else None,
        wo=torch.empty(h, q, dtype=dtype),
        ffn_norm=torch.empty(h, dtype=dtype),
        w_gate_up=torch.empty(2 * i, h, dtype=dtype),
        w_down=torch.empty(h, i, dtype=dtype),
    )


def layer_targets(layer: Layer, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Unit tensor name -> the (contiguous) part of `layer` it fills; from_unit's torch.cat, without the copy."""
    q, kv, i = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate
    out = {
        "attn_norm.weight": layer.attn_norm, "ffn_norm.weight": layer.ffn_norm,
        "wq.weight": layer.wqkv[:q], "wk.weight": layer.wqkv[q:q + kv], "wv.weight": layer.wqkv[q + kv:],
        "wo.weight": layer.wo, "w_gate.weight": layer.w_gate_up[:i], "w_up.weight": layer.w_gate_up[i:],
        "w_down.weight": layer.w_down,
    }
    if layer.bqkv is not None:
        out.update({"wq.bias": layer.bqkv[:q], "wk.bias": layer.bqkv[q:q + kv], "wv.bias": layer.bqkv[q + kv:]})
    return out


STREAM_UNITS = ("wqkv", "wo", "w_gate_up", "w_down")  # a layer's matrices: the units of residency and streaming
SMALL = ("attn_norm", "ffn_norm", "bqkv")  # norms and biases: always resident


def unit_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv, i = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate
    return {"wqkv": (q + 2 * kv, h), "wo": (h, q), "w_gate_up": (2 * i, h), "w_down": (h, i)}


def unit_targets(unit: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Unit file tensor name -> its part of the fused matrix `t` (one of STREAM_UNITS)."""
    q, kv, i = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate
    if unit == "wqkv":
        return {"wq.weight": t[:q], "wk.weight": t[q:q + kv], "wv.weight": t[q + kv:]}
    if unit == "w_gate_up":
        return {"w_gate.weight": t[:i], "w_up.weight": t[i:]}
    return {f"{unit}.weight": t}


def empty_small(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    """A layer's SMALL tensors, uninitialised (bqkv None without biases)."""
    h, q, kv = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"attn_norm": torch.empty(h, dtype=dtype), "ffn_norm": torch.empty(h, dtype=dtype),
            "bqkv": torch.empty(q + 2 * kv, dtype=dtype) if cfg.qkv_bias else None}


def small_targets(small: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Unit file tensor name -> its part of a layer's small tensors (SMALL; bqkv may be None)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"attn_norm.weight": small["attn_norm"], "ffn_norm.weight": small["ffn_norm"]}
    b = small.get("bqkv")
    if b is not None:
        out.update({"wq.bias": b[:q], "wk.bias": b[q:q + kv], "wv.bias": b[q + kv:]})
    return out


def layer_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Memory of one fused layer in `dtype`."""
    bias = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0
    return (cfg.layer_params() + bias) * dtype.itemsize


def head_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Memory of the head's embedding, final norm and (untied) output projection in `dtype`."""
    return (cfg.vocab * cfg.hidden * (1 if cfg.tie_embeddings else 2) + cfg.hidden) * dtype.itemsize


def kv_bytes(cfg: ModelConfig, dtype: torch.dtype, layers: int, tokens: int) -> int:
    """KV cache memory of `tokens` positions over `layers` layers."""
    return 2 * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize * layers * tokens
