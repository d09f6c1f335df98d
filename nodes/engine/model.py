"""Llama-family decoder math, written once and run over any layer range [start, stop)."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nodes.engine.quant import Format, Int4, Int8, embed_rows, linear
from prima_rpc.spec.manifest import ModelConfig

Weight = torch.Tensor | Int4 | Int8  # a matrix [N, K]: float, or quantized (engine/quant.py); used through linear()


def nbytes(w: Weight) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()


def matrix(t: dict[str, torch.Tensor], name: str, dtype: torch.dtype, fmt: Format | None) -> Weight:
    """Matrix `name` of a unit's tensors: float (`name.weight`) or quantized (`name.qweight`, `name.scales`;
    int8 values say int8 whatever the store's format)."""
    if f"{name}.qweight" not in t:
        return t[f"{name}.weight"].to(dtype)
    q = t[f"{name}.qweight"]
    return (Format("int8") if q.dtype == torch.int8 else fmt).weight(q, t[f"{name}.scales"], dtype)


@dataclass
class Layer:
    """One decoder layer's weights, fused for few matmuls per token."""

    attn_norm: torch.Tensor  # [H]
    wqkv: Weight  # [(nh + 2 nkv) * hd, H]
    bqkv: torch.Tensor | None  # [(nh + 2 nkv) * hd] (Qwen2)
    wo: Weight  # [H, nh * hd]
    ffn_norm: torch.Tensor  # [H]
    w_gate_up: Weight  # [2 I, H]
    w_down: Weight  # [H, I]

    @staticmethod
    def from_unit(t: dict[str, torch.Tensor], dtype: torch.dtype, fmt: Format | None = None) -> "Layer":
        """From a unit file's tensors: float stores hold q/k/v and gate/up apart, quantized ones fused."""
        bias = None
        if "wq.bias" in t:
            bias = torch.cat([t["wq.bias"], t["wk.bias"], t["wv.bias"]]).to(dtype)
        if fmt is None:
            t = dict(t, **{"wqkv.weight": torch.cat([t["wq.weight"], t["wk.weight"], t["wv.weight"]]),
                           "w_gate_up.weight": torch.cat([t["w_gate.weight"], t["w_up.weight"]])})
        return Layer(
            attn_norm=t["attn_norm.weight"].to(dtype),
            wqkv=matrix(t, "wqkv", dtype, fmt),
            bqkv=bias,
            wo=matrix(t, "wo", dtype, fmt),
            ffn_norm=t["ffn_norm.weight"].to(dtype),
            w_gate_up=matrix(t, "w_gate_up", dtype, fmt),
            w_down=matrix(t, "w_down", dtype, fmt),
        )

    def nbytes(self) -> int:
        parts = [self.attn_norm, self.wqkv, self.wo, self.ffn_norm, self.w_gate_up, self.w_down]
        parts += [self.bqkv] if self.bqkv is not None else []
        return sum(nbytes(p) for p in parts)


@dataclass
class OutputHead:
    """Embedding, final norm and output projection: what the head node holds besides layers."""

    embed: Weight  # [V, H]
    norm: torch.Tensor  # [H]
    output: Weight  # [V, H] (the embedding itself when tied)

    @staticmethod
    def from_units(embed: dict, head: dict, dtype: torch.dtype, tied: bool, fmt: Format | None = None) -> "OutputHead":
        emb = matrix(embed, "embed", dtype, fmt)
        out = emb if tied else matrix(head, "output", dtype, fmt)
        return OutputHead(embed=emb, norm=head["norm.weight"].to(dtype), output=out)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(self.embed, ids)  # [T, H]

    def logits(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """Float32 logits [T, V] of hidden states h [T, H]."""
        return linear(rms_norm(h, self.norm, eps), self.output).float()


class KVCache:
    """Keys and values of one request for the layers a node holds, preallocated to `capacity`."""

    def __init__(self, layers: list[int], cfg: ModelConfig, capacity: int, dtype: torch.dtype):
        self.capacity = capacity
        shape = (2, cfg.n_kv_heads, capacity, cfg.head_dim)  # k and v: [nkv, S, hd]
        self.kv = {i: torch.empty(shape, dtype=dtype) for i in layers}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv.values())


class Rope:
    """cos/sin tables [S, hd] for rotate-half RoPE, with optional llama3 frequency scaling."""

    def __init__(self, cfg: ModelConfig, length: int, dtype: torch.dtype):
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        if cfg.rope_scaling and cfg.rope_scaling.get("type") == "llama3":
            inv = llama3_scaled(inv, cfg.rope_scaling)
        angles = torch.outer(torch.arange(length, dtype=torch.float64), inv).float()
        angles = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def apply(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        # x: [heads, T, hd]
        t = x.shape[1]
        cos, sin = self.cos[pos:pos + t], self.sin[pos:pos + t]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


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


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 like the reference implementations, then scale in the compute dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


# A batch: the hidden rows of several requests concatenated [sum T, H]; one segment per request says where its
# rows' keys and values go. Norms, matmuls and the MLP run over all rows at once (one pass over the weights);
# RoPE and attention run per segment, with its own positions and KV cache. One request is a batch of one.
@dataclass(frozen=True)
class Segment:
    kv: torch.Tensor  # [2, nkv, S, hd] of this layer, updated in place
    pos: int  # position of the segment's first row
    t: int  # its rows


def layer_forward(x: torch.Tensor, layer: Layer, segs: list[Segment], cfg: ModelConfig, rope: Rope) -> torch.Tensor:
    """x: [sum T, H], the segments' rows in order."""
    h = attention_stage(x, layer.attn_norm, layer.wqkv, layer.bqkv, layer.wo, segs, cfg, rope)
    return down_stage(h, gate_up_stage(h, layer.ffn_norm, layer.w_gate_up, cfg), layer.w_down)


# A layer in three stages, each needing only some of its matrices (STAGES): a node streaming a layer
# computes each stage as soon as its matrices are read, and frees them right after.
STAGES = (("wqkv", "wo"), ("w_gate_up",), ("w_down",))


def attention_stage(x: torch.Tensor, attn_norm: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None,
                    wo: torch.Tensor, segs: list[Segment], cfg: ModelConfig, rope: Rope) -> torch.Tensor:
    qkv = linear(rms_norm(x, attn_norm, cfg.norm_eps), wqkv, bqkv)
    rows = qkv.split([s.t for s in segs]) if len(segs) > 1 else (qkv,)
    att = [_attend(r, s, cfg, rope) for r, s in zip(rows, segs, strict=True)]
    return x + linear(att[0] if len(att) == 1 else torch.cat(att), wo)


# A segment of up to ROW_ATTENTION rows (a decode step; a verify frame: up to 16 drafted tokens after the pending
# one; a short prompt) attends row by row, each row exactly as a one-token step at its position does: SDPA over
# several queries sums in another order (bfloat16: up to 2e-3 apart), which flipped SmolLM2 int4's greedy token on
# a near-tie when speculation was on. A float32 row is one SDPA call; a bfloat16 / float16 one two small float32
# matmuls: one bfloat16 query over 512 keys took SDPA 1.1 ms here and the matmuls 0.19 (with the cache's
# conversion; float32 SDPA 0.05-0.07). Longer segments (prefill chunks) are one SDPA call: they are computed alike
# with or without speculation.
ROW_ATTENTION = 17


def _attend(qkv: torch.Tensor, seg: Segment, cfg: ModelConfig, rope: Rope) -> torch.Tensor:
    """One segment's attention: qkv [T, (nh + 2 nkv) hd] -> [T, nh hd]; its keys and values go to its cache."""
    t, kv, pos = seg.t, seg.kv, seg.pos
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    heads = qkv.view(t, nh + 2 * nkv, hd).transpose(0, 1)
    q, k = rope.apply(heads[:nh + nkv], pos).split([nh, nkv])  # q and k rotated at once: half the ops
    kv[0, :, pos:pos + t] = k
    kv[1, :, pos:pos + t] = heads[nh + nkv:]
    if t <= ROW_ATTENTION:
        att = _attend_rows(q, kv[:, :, :pos + t], pos) if q.dtype == torch.float32 else \
            _attend_rows_float32(q, kv[:, :, :pos + t].float(), pos)  # converted once for all its rows
        return att[0] if t == 1 else torch.cat(att)
    mask = None
    if pos > 0:  # chunked prefill: each new token sees the cache and its predecessors
        mask = torch.ones(t, pos + t, dtype=torch.bool).tril(diagonal=pos)
    att = F.scaled_dot_product_attention(
        q.unsqueeze(0), kv[None, 0, :, :pos + t], kv[None, 1, :, :pos + t],
        attn_mask=mask, is_causal=pos == 0, enable_gqa=nh != nkv,
    )  # [1, nh, T, hd]
    return att[0].transpose(0, 1).reshape(t, nh * hd)


def _attend_rows(q: torch.Tensor, kv: torch.Tensor, pos: int) -> list[torch.Tensor]:
    """q [nh, T, hd] at positions [pos, pos + T) over kv [2, nkv, pos + T, hd] -> T rows [1, nh hd], each one SDPA
    call over the keys up to its own position."""
    nh, t, hd = q.shape
    gqa = nh != kv.shape[1]
    return [F.scaled_dot_product_attention(q[None, :, i:i + 1], kv[None, 0, :, :pos + i + 1],
                                           kv[None, 1, :, :pos + i + 1], enable_gqa=gqa).reshape(1, nh * hd)
            for i in range(t)]


def _attend_rows_float32(q: torch.Tensor, kv: torch.Tensor, pos: int) -> list[torch.Tensor]:
    """The same in float32 matmuls, q in a half dtype over kv float32: rows [1, nh hd] in q's dtype. Query head h
    reads key head h // (nh / nkv), as SDPA's enable_gqa does."""
    nh, t, hd = q.shape
    nkv = kv.shape[1]
    rows = []
    for i in range(t):
        keys, values = kv[0, :, :pos + i + 1], kv[1, :, :pos + i + 1]  # [nkv, S, hd]
        scores = torch.bmm(q[:, i].float().view(nkv, nh // nkv, hd), keys.transpose(1, 2)).mul_(hd ** -0.5)
        rows.append(torch.bmm(torch.softmax(scores, dim=-1), values).view(1, nh * hd).to(q.dtype))  # [nkv, g, hd]
    return rows


def gate_up_stage(h: torch.Tensor, ffn_norm: torch.Tensor, w_gate_up: Weight, cfg: ModelConfig) -> torch.Tensor:
    gate, up = linear(rms_norm(h, ffn_norm, cfg.norm_eps), w_gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up


def down_stage(h: torch.Tensor, a: torch.Tensor, w_down: Weight) -> torch.Tensor:
    return h + linear(a, w_down)


def run_layers(x: torch.Tensor, layers: dict[int, Layer], start: int, stop: int, cache: KVCache, pos: int,
               cfg: ModelConfig, rope: Rope) -> torch.Tensor:
    """Hidden states after layers [start, stop), all of which must be in `layers`."""
    for i in range(start, stop):
        x = layer_forward(x, layers[i], [Segment(cache.kv[i], pos, x.shape[0])], cfg, rope)
    return x
