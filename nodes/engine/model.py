"""Llama-family decoder math, written once and run over any layer range [start, stop)."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nodes.engine import layer_calls, window_calls
from nodes.engine.activation import ACTIVATIONS, gated
from nodes.engine.formats import Format
from nodes.engine.kernels import ops
from nodes.engine.kv_dtype import FLOAT, KVDtype, stored_as
from nodes.engine.moe import Expert, MoE, moe_mlp
from nodes.engine.quant import Int4, Int8, Rows, embed_rows, linear
from nodes.engine.rope import Rope
from nodes.engine.row_attention import ROW_ATTENTION, attend_rows
from prima_rpc.spec.manifest import ModelConfig
from prima_rpc.spec.shapes import FUSED, SHARED_FUSED

Weight = torch.Tensor | Int4 | Int8 | Rows  # a matrix [N, K]: float, or quantized (engine/quant.py); through linear()


def nbytes(w: Weight) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()


def matrix(t: dict[str, torch.Tensor], name: str, dtype: torch.dtype, fmt: Format | None) -> Weight:
    """Matrix `name` of a unit's tensors: float (`name.weight`) or quantized (`name.qweight`, `name.scales`;
    int8 values say int8 whatever the store's format), or row-range pieces of such (`name.0.qweight`, ...:
    formats.Format.pieces)."""
    if f"{name}.0.qweight" in t:
        return Rows([matrix(t, f"{name}.{j}", dtype, fmt) for j in range(len(t)) if f"{name}.{j}.qweight" in t])
    if f"{name}.qweight" not in t:
        return t[f"{name}.weight"].to(dtype)
    q = t[f"{name}.qweight"]
    return (Format("int8") if q.dtype == torch.int8 else fmt).weight(q, t[f"{name}.scales"], dtype)


def fuse_float(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float unit's tensors plus its fused matrices (FUSED, SHARED_FUSED) that it holds the parts of."""
    fused = {**FUSED, **SHARED_FUSED}
    return dict(t, **{f"{name}.weight": torch.cat([t[f"{p}.weight"] for p in parts]) if len(parts) > 1
                      else t[f"{parts[0]}.weight"] for name, parts in fused.items() if f"{parts[0]}.weight" in t})


def expert(t: dict[str, torch.Tensor], dtype: torch.dtype, fmt: Format | None, prefix: str = "w") -> Expert:
    """An expert from its unit's tensors (prefix "ws": the shared expert, in its layer's unit)."""
    t = fuse_float(t) if fmt is None else t
    return Expert(matrix(t, f"{prefix}_gate_up", dtype, fmt), matrix(t, f"{prefix}_down", dtype, fmt))


def mixture(t: dict[str, torch.Tensor], experts: dict[int, Expert], dtype: torch.dtype, fmt: Format | None,
            cfg: ModelConfig) -> MoE:
    """A layer's mixture from its unit's tensors (router, shared expert) and its experts."""
    shared = "ws_down.weight" in t or "ws_down.qweight" in t
    return MoE(router=t["router.weight"].float(), experts=experts, top_k=cfg.n_experts_used,
               norm_topk=cfg.norm_topk_prob, shared=expert(t, dtype, fmt, "ws") if shared else None,
               shared_gate=t["shared_gate.weight"].to(dtype) if shared else None)


SMALL = ("attn_norm", "ffn_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")  # always resident


@dataclass
class Layer:
    """One decoder layer's weights, fused for few matmuls per token (None: the architecture has no such tensor)."""

    attn_norm: torch.Tensor  # [H]
    wqkv: Weight  # [(nh + 2 nkv) * hd, H]
    bqkv: torch.Tensor | None  # [(nh + 2 nkv) * hd] (Qwen2)
    wo: Weight  # [H, nh * hd]
    ffn_norm: torch.Tensor  # [H]
    w_gate_up: Weight | None  # [2 I, H] (None: the MLP is a mixture of experts, `moe`)
    w_down: Weight | None  # [H, I]
    q_norm: torch.Tensor | None = None  # [hd] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [hd]
    post_attn_norm: torch.Tensor | None = None  # [H] (Gemma 3)
    post_ffn_norm: torch.Tensor | None = None  # [H]
    moe: MoE | None = None  # a mixture of experts' MLP (nodes/engine/moe.py)
    bound: "layer_calls.Bound | None" = field(default=None, init=False, repr=False, compare=False)  # its C calls'
    # window_calls' runs of layers from this one, by their stop
    runs: "dict[int, window_calls.Run]" = field(default_factory=dict, init=False, repr=False, compare=False)

    @staticmethod
    def from_unit(t: dict[str, torch.Tensor], dtype: torch.dtype, fmt: Format | None = None,
                  moe: Callable[[dict[str, torch.Tensor]], MoE] | None = None) -> "Layer":
        """From a unit file's tensors: float stores hold q/k/v and gate/up apart, quantized ones fused; a mixture of
        experts' layer gets its MLP from moe(tensors) (`mixture` of its experts)."""
        bias = None
        if "wq.bias" in t:
            bias = torch.cat([t["wq.bias"], t["wk.bias"], t["wv.bias"]]).to(dtype)
        t = fuse_float(t) if fmt is None else t
        norms = {n: t[f"{n}.weight"].to(dtype) for n in SMALL if f"{n}.weight" in t}
        mlp = dict(moe=moe(t)) if moe else dict(w_gate_up=matrix(t, "w_gate_up", dtype, fmt),
                                                 w_down=matrix(t, "w_down", dtype, fmt))
        return Layer(wqkv=matrix(t, "wqkv", dtype, fmt), bqkv=bias, wo=matrix(t, "wo", dtype, fmt),
                     **{"w_gate_up": None, "w_down": None, **mlp}, **norms)

    def small(self) -> dict[str, torch.Tensor | None]:
        """Norms and biases by SMALL name (what a streamed layer keeps resident)."""
        return {n: getattr(self, n) for n in SMALL}

    def nbytes(self) -> int:
        parts = [self.wqkv, self.wo] + ([self.w_gate_up, self.w_down] if self.moe is None else self.moe.weights())
        return sum(nbytes(p) for p in parts + [t for t in self.small().values() if t is not None])


@dataclass
class OutputHead:
    """Embedding, final norm and output projection: what the head node holds besides layers."""

    embed: Weight  # [V, H]
    norm: torch.Tensor  # [H]
    output: Weight  # [V, H] (the embedding itself when tied)
    embed_scale: float = 1.0  # Gemma: sqrt(H)
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) (Gemma)

    @staticmethod
    def from_units(embed: dict, head: dict, dtype: torch.dtype, tied: bool, fmt: Format | None = None,
                   **numerics) -> "OutputHead":
        """numerics: head_numerics(cfg) (none: Llama's)."""
        emb = matrix(embed, "embed", dtype, fmt)
        out = emb if tied else matrix(head, "output", dtype, fmt)
        return OutputHead(embed=emb, norm=head["norm.weight"].to(dtype), output=out, **numerics)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        x = embed_rows(self.embed, ids)  # [T, H]
        # Gemma multiplies by sqrt(H) rounded to the weights' dtype
        return x if self.embed_scale == 1.0 else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def logits(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """Float32 logits [T, V] of hidden states h [T, H]."""
        logits = linear(rms_norm(h, self.norm, eps), self.output).float()
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


def head_numerics(cfg: ModelConfig) -> dict:
    """OutputHead's architecture-dependent numbers."""
    return {"embed_scale": math.sqrt(cfg.hidden) if cfg.arch.embed_scale else 1.0, "softcap": cfg.logit_softcap}


class KVCache:
    """Keys and values of one request for the layers a node holds, preallocated to `capacity`; a sliding-window
    layer holds a ring of `window_slots` positions instead (position p in slot p % slots) when that is fewer. Rows are
    stored as `kv_dtype` keeps them (nodes/engine/kv_dtype.py: float in `dtype`, or quantized bytes)."""

    def __init__(self, layers: list[int], cfg: ModelConfig, capacity: int, dtype: torch.dtype,
                 kv_dtype: KVDtype = FLOAT):
        self.capacity = capacity
        ring = window_slots(cfg)
        local = frozenset(cfg.local_layers) if ring < capacity else frozenset()
        self.kv = {i: kv_dtype.empty(cfg.n_kv_heads, ring if i in local else capacity, cfg.head_dim, dtype)
                   for i in layers}  # k and v: [nkv, S, hd] (quantized: [nkv, S, row bytes])
        self.prefix_save: tuple[str, int] | None = None  # (key, length): keep [0, length) once computed (prefix cache)
        self.runs: dict[tuple[int, int], window_calls.RunKV] = {}  # window_calls' KV arrays, by (start, stop)
        self.shared_bytes = 0  # of kv, pages mapped from a cached prefix (counted there: PrefixCache.take)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv.values()) - self.shared_bytes

    def reusable_prefix(self, n: int) -> int:
        """How many of the first n positions another request may copy from this cache: all n where every layer
        still holds them (a ring is not past its slots), else none (a windowed layer's ring lost the prompt's
        start). Meant right after a prefill of n positions; later writes may wrap a ring further."""
        return n if all(kv.shape[2] >= n for kv in self.kv.values()) else 0


def window_slots(cfg: ModelConfig) -> int:
    """A sliding-window layer's ring: its window plus a verify frame's rows (ROW_ATTENTION), so that rejected
    drafts never overwrite a position the next step still sees."""
    return cfg.sliding_window + ROW_ATTENTION if cfg.local_layers else 0


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if ops.fits(x, w):  # float32: one C call for these 7 ops
        return ops.rms_norm(x, w, eps)
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
    """x: [sum T, H], the segments' rows in order; rope: this layer's (Rope.layer)."""
    y = layer_calls.forward(x, layer, segs, cfg, rope)  # few float32 rows: 2 C calls
    if y is not None:
        return y
    h = attention_stage(x, layer.small(), layer.wqkv, layer.wo, segs, cfg, rope)
    if layer.moe is not None:
        return moe_stage(h, layer.ffn_norm, layer.moe, cfg)
    a = gate_up_stage(h, layer.ffn_norm, layer.w_gate_up, cfg)
    return down_stage(h, a, layer.w_down, layer.post_ffn_norm, cfg.norm_eps)


# A layer in three stages, each needing only some of its matrices (STAGES): a node streaming a layer
# computes each stage as soon as its matrices are read, and frees them right after.
STAGES = (("wqkv", "wo"), ("w_gate_up",), ("w_down",))


def attention_stage(x: torch.Tensor, small: dict, wqkv: Weight, wo: Weight, segs: list[Segment], cfg: ModelConfig,
                    rope: Rope) -> torch.Tensor:
    """small: the layer's norms and biases (Layer.small)."""
    qkv = linear(rms_norm(x, small["attn_norm"], cfg.norm_eps), wqkv, small["bqkv"])
    rows = qkv.split([s.t for s in segs]) if len(segs) > 1 else (qkv,)
    att = [_attend(r, s, small, cfg, rope) for r, s in zip(rows, segs, strict=True)]
    out = linear(att[0] if len(att) == 1 else torch.cat(att), wo)
    return x + (out if small["post_attn_norm"] is None else rms_norm(out, small["post_attn_norm"], cfg.norm_eps))


def _attend(qkv: torch.Tensor, seg: Segment, small: dict, cfg: ModelConfig, rope: Rope) -> torch.Tensor:
    """One segment's attention: qkv [T, (nh + 2 nkv) hd] -> [T, nh hd]; its keys and values go to its cache."""
    t, kv, pos = seg.t, seg.kv, seg.pos
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    scale = (cfg.query_scale or hd) ** -0.5
    qn, kn = small["q_norm"], small["k_norm"]
    head_norms = () if qn is None else (qn, kn)
    if t <= ROW_ATTENTION and pos + t <= kv.shape[2] and ops.fits(qkv, kv, rope.cos, *head_norms):
        return ops.attend_rows(qkv, rope.cos, rope.sin, kv, pos, nh, rope.window, scale, qn, kn, cfg.norm_eps)
    heads = qkv.view(t, nh + 2 * nkv, hd).transpose(0, 1)
    qk = heads[:nh + nkv]
    if qn is not None:  # per-head norms before RoPE (Qwen3, Gemma 3); contiguous: rms_norm's C call for float32
        qk = torch.cat([rms_norm(qk[:nh].contiguous(), qn, cfg.norm_eps),
                        rms_norm(qk[nh:].contiguous(), kn, cfg.norm_eps)])
    q, k = rope.apply(qk, pos).split([nh, nkv])  # q and k rotated at once: half the ops
    stored = stored_as(kv, hd)
    if stored.quantized:
        return _attend_packed(q, k, heads[nh + nkv:], kv, stored, pos, rope.window, scale)
    if pos + t > kv.shape[2]:  # a sliding-window layer's ring has wrapped
        return _attend_ring(q, k, heads[nh + nkv:], kv, pos, rope.window, scale)
    kv[0, :, pos:pos + t] = k
    kv[1, :, pos:pos + t] = heads[nh + nkv:]
    return _attend_cached(q, kv[:, :, :pos + t], pos, rope.window, scale)


def _attend_cached(q: torch.Tensor, kv: torch.Tensor, pos: int, window: int | None, scale: float) -> torch.Tensor:
    """q [nh, T, hd] at positions [pos, pos + T) over keys and values kv [2, nkv, pos + T, hd] -> [T, nh hd]."""
    nh, t, hd = q.shape
    if t <= ROW_ATTENTION:  # decode steps and verify frames: each row as a one-token step computes it
        return attend_rows(q, kv, pos, window, scale)
    keys, values = kv[0], kv[1]
    mask = window_mask(pos, t, window)
    if mask is None and pos > 0:  # chunked prefill: each new token sees the cache and its predecessors
        mask = torch.ones(t, pos + t, dtype=torch.bool).tril(diagonal=pos)
    att = F.scaled_dot_product_attention(
        q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
        is_causal=(pos == 0 and mask is None), enable_gqa=nh != kv.shape[1], scale=scale,
    )  # [1, nh, T, hd]
    return att[0].transpose(0, 1).reshape(t, nh * hd)


def _attend_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, stored: KVDtype, pos: int,
                   window: int | None, scale: float) -> torch.Tensor:
    """Attention over a quantized cache: the segment's keys and values are stored, then every position the rows see
    is read back (its own too, as the next step will see them) and attended in the compute dtype. Each position's
    rows are quantized alone, so a request gets the same bits alone and in a batch."""
    t, hd, dtype = q.shape[1], q.shape[2], q.dtype
    own = stored.pack(torch.stack([k, v]), dtype)  # [2, nkv, T, row bytes]
    if pos + t <= kv.shape[2]:
        kv[:, :, pos:pos + t] = own
        return _attend_cached(q, stored.unpack(kv[:, :, :pos + t], hd, dtype), pos, window, scale)
    slots, lo = kv.shape[2], max(0, pos - window + 1)  # a sliding-window layer's ring has wrapped
    held = stored.unpack(kv[:, :, torch.arange(lo, pos) % slots], hd, dtype)
    seen = torch.cat([held, stored.unpack(own, hd, dtype)], dim=2)  # positions [lo, pos + T)
    new = torch.arange(max(pos, pos + t - slots), pos + t)
    kv[:, :, new % slots] = own[:, :, new - pos]
    return _attend_cached(q, seen, pos - lo, window, scale)


def window_mask(pos: int, t: int, window: int | None) -> torch.Tensor | None:
    """Queries at [pos, pos + T) over keys at [0, pos + T): a local layer sees its last `window` positions (None:
    no window, or none of its rows reaches past one)."""
    if window is None or pos + t <= window:
        return None
    rows = torch.arange(pos, pos + t).unsqueeze(1)  # [T, 1] query positions; [1, pos + T] key positions
    return (torch.arange(pos + t) <= rows) & (torch.arange(pos + t) > rows - window)


def _attend_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: torch.Tensor, pos: int, window: int,
                 scale: float) -> torch.Tensor:
    """Attention of a windowed layer whose cache is a ring: the window's cached positions [lo, pos) in order and
    the segment's own keys, as keys at positions [lo, pos + T); then the newest of them go into the ring."""
    nh, t, hd = q.shape
    slots, lo = ring.shape[2], max(0, pos - window + 1)
    held = torch.arange(lo, pos) % slots
    kv = torch.cat([ring[:, :, held], torch.stack([k, v])], dim=2)  # [2, nkv, pos + T - lo, hd]
    new = torch.arange(max(pos, pos + t - slots), pos + t)
    ring[:, :, new % slots] = kv[:, :, new - lo]
    if t <= ROW_ATTENTION:
        return attend_rows(q, kv, pos - lo, window, scale)
    att = F.scaled_dot_product_attention(q[None], kv[None, 0], kv[None, 1], attn_mask=window_mask(pos - lo, t, window),
                                         enable_gqa=nh != kv.shape[1], scale=scale)
    return att[0].transpose(0, 1).reshape(t, nh * hd)


def gate_up_stage(h: torch.Tensor, ffn_norm: torch.Tensor, w_gate_up: Weight, cfg: ModelConfig) -> torch.Tensor:
    return gated(linear(rms_norm(h, ffn_norm, cfg.norm_eps), w_gate_up), cfg.arch.act)


def moe_stage(h: torch.Tensor, ffn_norm: torch.Tensor, moe: MoE, cfg: ModelConfig) -> torch.Tensor:
    """A mixture of experts in place of the gated MLP (gate_up_stage, down_stage)."""
    return h + moe_mlp(rms_norm(h, ffn_norm, cfg.norm_eps), moe, ACTIVATIONS[cfg.arch.act])


def down_stage(h: torch.Tensor, a: torch.Tensor, w_down: Weight, post_norm: torch.Tensor | None = None,
               eps: float = 0.0) -> torch.Tensor:
    """post_norm: Gemma 3's norm of the MLP's output (eps: its epsilon)."""
    out = linear(a, w_down)
    return h + (out if post_norm is None else rms_norm(out, post_norm, eps))


def run_layers(x: torch.Tensor, layers: dict[int, Layer], start: int, stop: int, cache: KVCache, pos: int,
               cfg: ModelConfig, rope: Rope) -> torch.Tensor:
    """Hidden states after layers [start, stop), all of which must be in `layers`: a decode step's as one C call
    where window_calls takes them (as Shard.compute_batch runs them), else layer by layer."""
    y = window_calls.forward(x, layers, start, stop, [(cache, pos, x.shape[0])], cfg, rope)
    if y is not None:
        return y
    for i in range(start, stop):
        x = layer_forward(x, layers[i], [Segment(cache.kv[i], pos, x.shape[0])], cfg, rope.layer(i))
    return x
