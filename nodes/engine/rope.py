"""Rotary position tables of every rope scaling a store can name (ModelConfig.rope_scaling), as transformers
computes them, and their use on the first `rotary_dim` of each head's dimensions."""

import math

import torch

from prima_rpc.spec.manifest import ModelConfig


class Rope:
    """cos/sin tables [S, rotary_dim] for rotate-half RoPE, and the attention window of the layers that use it;
    `layer(i)` picks a layer's (local layers: their own window and, in Gemma 3, their own base)."""

    def __init__(self, cfg: ModelConfig, length: int, dtype: torch.dtype, local: bool = False):
        own_base = local and cfg.local_rope_theta is not None  # Gemma 3's local layers: own base, no scaling
        theta = cfg.local_rope_theta if own_base else cfg.rope_theta
        self.dim = cfg.rotary_dim or cfg.head_dim
        angles, attention_factor = rope_angles(theta, self.dim, None if own_base else cfg.rope_scaling, length)
        angles = torch.cat([angles, angles], dim=-1).float()  # cos/sin in float32, as transformers takes them
        # the attention factor (YaRN, LongRoPE) scales q and k alike: softmax's temperature
        self.cos, self.sin = (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)
        self.window = cfg.sliding_window if local else None  # None: every earlier position
        self.local_layers = frozenset(cfg.local_layers)
        self.local = Rope(cfg, length, dtype, local=True) if cfg.local_layers and not local else None

    def layer(self, i: int) -> "Rope":
        return self.local if i in self.local_layers else self

    def apply(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        # x: [heads, T, hd]; dimensions past rotary_dim pass through unrotated (partial rotary)
        t, r = x.shape[1], self.dim
        cos, sin = self.cos[pos:pos + t], self.sin[pos:pos + t]
        rot = x[..., :r]
        rotated = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], dim=-1)
        out = rot * cos + rotated * sin
        return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


def rope_angles(theta: float, dim: int, s: dict | None, length: int) -> tuple[torch.Tensor, float]:
    """Angles [length, dim / 2] (float64) of positions 0 .. length - 1 and the attention factor, under scaling s."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    positions = torch.arange(length, dtype=torch.float64)
    kind = s["type"] if s else "default"
    if kind not in SCALINGS:
        raise ValueError(f"unknown rope scaling {kind!r}; known: {sorted(SCALINGS)}")
    return SCALINGS[kind](inv, positions, s or {}, theta, dim)


def _fixed(scale):
    """A scaling whose frequencies are the same at every position: scale(inv, s, theta) -> (inv, attention
    factor)."""
    def angles(inv, positions, s, theta, dim):
        inv, factor = scale(inv, s, theta)
        return torch.outer(positions, inv), factor
    return angles


def llama3_scaled(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's long-context frequency scaling (as in transformers' rope utils)."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


def yarn_scaled(inv: torch.Tensor, s: dict, base: float) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5 / Qwen3 long context, DeepSeek): high frequencies kept, low ones interpolated by `factor`, a
    linear ramp between (beta_fast / beta_slow rotations over the original context), and an attention factor."""
    factor, orig = s["factor"], s["original_max_position_embeddings"]
    dim = 2 * len(inv)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp  # 1: the frequency as trained, 0: interpolated
    return inv / factor * (1 - extrapolated) + inv * extrapolated, yarn_attention_factor(s)


def yarn_attention_factor(s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if s.get("mscale") and s.get("mscale_all_dim"):  # DeepSeek
        return mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"])
    return mscale(s["factor"])


def longrope_angles(inv, positions, s, theta, dim):
    """Phi-3.5 / Phi-4-mini's LongRoPE: per-frequency divisors, the long set where the table reaches past the
    original context (the store's max_seq_len), else the short one. llama.cpp chooses so by its context size;
    transformers uses the short set until a sequence crosses the original length, then recomputes the whole
    sequence with the long one: they agree on sequences longer than that."""
    factors = s["long_factor"] if len(positions) > s["original_max_position_embeddings"] else s["short_factor"]
    return torch.outer(positions, inv / torch.tensor(factors, dtype=torch.float64)), float(s["attention_factor"])


def dynamic_angles(inv, positions, s, theta, dim):
    """Dynamic NTK scaling: past the original context the base grows with the sequence; a position's row uses the
    base of a sequence ending there (as transformers' decode steps do)."""
    factor, orig = s["factor"], s["original_max_position_embeddings"]
    seq = torch.clamp(positions + 1, min=orig)[:, None]
    base = theta * (factor * seq / orig - (factor - 1)) ** (dim / (dim - 2))  # [S, 1]
    return positions[:, None] * base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0


SCALINGS = {  # ModelConfig.rope_scaling["type"] -> angles(inv, positions, s, theta, dim) -> (angles, factor)
    "default": _fixed(lambda inv, s, theta: (inv, 1.0)),
    "linear": _fixed(lambda inv, s, theta: (inv / s["factor"], 1.0)),
    "llama3": _fixed(lambda inv, s, theta: (llama3_scaled(inv, s), 1.0)),
    # a GGUF's rope_freqs (llama.cpp's llama3 scaling): each frequency divided by its factor
    "factors": _fixed(lambda inv, s, theta: (inv / torch.tensor(s["factors"], dtype=torch.float64), 1.0)),
    "yarn": _fixed(yarn_scaled),
    "longrope": longrope_angles,
    "dynamic": dynamic_angles,
}
