"""A decode step's layer (a few float32 rows) as two C calls around its activation (activation.gated: ops.c's silu),
where all of its matrices run our kernels: ops.c's attention_block (norm, qkv, RoPE + KV write + row attention per
segment, wo, residual, norm, gate_up) and down_block (down, residual). The same functions in the same order as
model.layer_forward's torch steps, so the same bits (tests/test_layer_calls.py); what it saves is Python: a layer was
~15 dispatches; SmolLM2 int4's layers took 7.41 -> 7.02 ms a token at one thread on an AVX-512 Xeon
(docs/performance.md, session 20). A run of such layers goes as one call where it can (window_calls); this is the
path for a layer alone (a streamed layer's neighbours, a wrapped ring, Gemma's gelu)."""

from dataclasses import dataclass
from operator import attrgetter, is_

import torch

from nodes.engine.activation import gated
from nodes.engine.kernels import ops
from nodes.engine.quant import FEW_ROWS, kernel_matrix
from nodes.engine.row_attention import ROW_ATTENTION

NORMS = ("attn_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm")
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


@dataclass(frozen=True)
class Bound:
    """A layer's matrices and norms as the C calls take them, and the objects they were taken from: used while the
    layer still holds those very objects (a layer whose weights are replaced is bound again)."""

    held: tuple
    matrices: tuple[ops.Matrix, ...] | None  # None: some matrix is not one of our kernels'
    norms: tuple[int, ...]  # data pointers, 0 for none


HELD = attrgetter(*MATRICES, *NORMS)


def bind(layer) -> Bound:
    held = HELD(layer)
    bound = layer.bound
    if bound is not None and all(map(is_, bound.held, held)):  # C loops: checked every decode step
        return bound
    matrices = tuple(kernel_matrix(getattr(layer, n)) for n in MATRICES)
    norms = tuple(0 if t is None else t.data_ptr() for t in (getattr(layer, n) for n in NORMS))
    floats = all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in held[len(MATRICES):])
    layer.bound = Bound(held, matrices if floats and None not in matrices else None, norms)
    return layer.bound


def fits(x: torch.Tensor, layer, segs, rope) -> bool:
    """Whether these rows and segments take the C calls: float32 rows, few enough for f32.c's guarantee
    (quant.FEW_ROWS), each segment within ops.c's row attention, no mixture of experts."""
    return (x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= FEW_ROWS and x.is_contiguous()
            and layer.moe is None and ops.fits(rope.cos, rope.sin)
            and all(s.t <= ROW_ATTENTION and s.pos + s.t <= s.kv.shape[2] and ops.fits(s.kv) for s in segs))


def forward(x: torch.Tensor, layer, segs, cfg, rope) -> torch.Tensor | None:
    """model.layer_forward(x, layer, segs, cfg, rope) through the C calls, None where they do not apply (fits, bind):
    the caller's torch steps run then."""
    if not fits(x, layer, segs, rope):
        return None
    bound = bind(layer)
    if bound.matrices is None:
        return None
    wqkv, wo, w_gate_up, w_down = bound.matrices
    h, gu = ops.attention_block(x, bound.norms[:6], wqkv, wo, w_gate_up, [(s.kv, s.pos, s.t) for s in segs],
                                rope.cos, rope.sin, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, rope.window,
                                (cfg.query_scale or cfg.head_dim) ** -0.5, cfg.norm_eps)
    return ops.down_block(h, gated(gu, cfg.arch.act), w_down, bound.norms[6], cfg.norm_eps)  # as model.gate_up_stage
