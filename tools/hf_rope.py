"""A Hugging Face config.json's rotary embedding as a store names it: base, scaling (nodes/engine/rope.py's
SCALINGS) and rotary dimensions, from transformers 5's `rope_parameters` or the older `rope_scaling` keys."""

import math

from prima_rpc.spec.manifest import StoreError

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate")
SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def layer_params(hf: dict, kind: str) -> dict:
    """rope_parameters of one layer type (Gemma 3 nests one per type), else the one dict."""
    params = hf.get("rope_parameters") or {}
    return params.get(kind, params) if kind in params or "full_attention" in params else params


def rope(hf: dict, kind: str = "full_attention") -> tuple[float, dict | None]:
    """rope_theta and the store's rope_scaling of one layer type."""
    params = layer_params(hf, kind)
    old_theta = hf.get("rope_local_base_freq", 10000.0) if kind == "sliding_attention" else hf.get("rope_theta")
    theta = float(params.get("rope_theta", old_theta or 10000.0))
    s = params if ("rope_type" in params or "type" in params) else (hf.get("rope_scaling") or {})
    if kind == "sliding_attention" and "rope_parameters" not in hf:
        s = {}  # Gemma 3's older configs: rope_scaling is the global layers'
    rope_type = s.get("rope_type", s.get("type", "default"))
    rope_type = {"su": "longrope", "dynamic_ntk": "dynamic"}.get(rope_type, rope_type)  # older names
    if rope_type not in SUPPORTED:
        raise StoreError(f"rope scaling {rope_type!r} is not supported (only {', '.join(SUPPORTED[1:])})")
    max_pos = int(hf.get("max_position_embeddings", 4096))
    # Phi-3 keeps the pretraining length beside rope_scaling; transformers gives it priority
    orig = int(hf.get("original_max_position_embeddings") or s.get("original_max_position_embeddings") or max_pos)
    return theta, SCALINGS[rope_type](s, orig, max_pos)


def _llama3(s: dict, orig: int, max_pos: int) -> dict:
    missing = [k for k in LLAMA3_KEYS if k not in s]
    if missing:
        raise StoreError(f"llama3 rope scaling lacks {missing}")
    return {"type": "llama3", **{k: s[k] for k in LLAMA3_KEYS}}


def _yarn(s: dict, orig: int, max_pos: int) -> dict:
    out = {k: s[k] for k in YARN_KEYS if s.get(k) is not None}
    # DeepSeek-V3 gives no factor: the ratio of the lengths
    return {"type": "yarn", **out, "factor": float(s.get("factor") or max_pos / orig),
            "original_max_position_embeddings": orig}


def _longrope(s: dict, orig: int, max_pos: int) -> dict:
    if not (s.get("short_factor") and s.get("long_factor")):
        raise StoreError("longrope rope scaling lacks short_factor or long_factor")
    factor = float(s.get("factor") or max_pos / orig)
    attention = s.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
    return {"type": "longrope", "short_factor": [float(v) for v in s["short_factor"]],
            "long_factor": [float(v) for v in s["long_factor"]], "original_max_position_embeddings": orig,
            "attention_factor": float(attention)}


SCALINGS = {
    "default": lambda s, orig, max_pos: None,
    "linear": lambda s, orig, max_pos: {"type": "linear", "factor": float(s["factor"])},
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
    # dynamic NTK grows the base past max_position_embeddings itself (transformers' "original" length there)
    "dynamic": lambda s, orig, max_pos: {"type": "dynamic", "factor": float(s["factor"]),
                                         "original_max_position_embeddings": max_pos},
}


def rotary_dim(hf: dict, head_dim: int) -> int | None:
    """How many of a head's dimensions RoPE turns (partial_rotary_factor: Phi-4-mini, StableLM); None: all."""
    params = layer_params(hf, "full_attention")
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    dim = int(head_dim * factor)
    return None if dim == head_dim else dim


def context_length(max_pos: int, scaling: dict | None) -> int:
    """Positions the store's tables cover: the model's max_pos, or the length YaRN / dynamic NTK stretch the
    original context to where that is longer (a GGUF's importer uses it too)."""
    if scaling and scaling["type"] in ("yarn", "dynamic"):
        return max(max_pos, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return max_pos
