"""A layer's float32 steps between matmuls as one C call each (ops.c): RMSNorm, and a segment's RoPE + KV cache
write + one-row attention; a gated MLP's silu(gate) * up with an exp of its own (the same bits on every ISA); a
decode step's whole layer as two calls around its activation (attention_block, down_block:
nodes/engine/layer_calls.py), and a run of such layers as one (window: nodes/engine/window_calls.py). Used where
ops.c builds (x86 with AVX2 and up, aarch64) for float32 activations; elsewhere, and for other dtypes, the torch
ops of nodes/engine/model.py and row_attention.py run. Callers check `fits` first."""

import ctypes
from functools import cache

import torch

from nodes.engine.kernels.build import library


@cache
def _lib() -> ctypes.CDLL | None:
    lib = library("ops")
    if lib is not None:
        p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.prima_rms_norm.argtypes = [p] * 3 + [i] * 2 + [f]
        lib.prima_rms_norm.restype = None
        lib.prima_attend_rows.argtypes = [p] * 5 + [i] * 8 + [f, p, p, f, ctypes.c_int]
        lib.prima_attend_rows.restype = ctypes.c_int
        m, seg = ctypes.POINTER(Matrix), ctypes.POINTER(Segment)
        lib.prima_attention_block.argtypes = [p] * 3 + [i] * 2 + [p] * 4 + [m] * 2 + [p] * 2 + [m, seg, i, p, p] + [
            i] * 5 + [f] * 2 + [ctypes.c_int]
        lib.prima_attention_block.restype = ctypes.c_int
        lib.prima_down_block.argtypes = [p] * 3 + [i, m, p, f, ctypes.c_int]
        lib.prima_down_block.restype = ctypes.c_int
        lib.prima_silu_mul.argtypes = [p] * 2 + [i] * 2 + [ctypes.c_int]
        lib.prima_silu_mul.restype = None
        lib.prima_window.argtypes = [p] * 2 + [i] * 2 + [p, i, p, p] + [i] * 4 + [f] * 2 + [ctypes.c_int]
        lib.prima_window.restype = ctypes.c_int
    return lib


class Matrix(ctypes.Structure):
    """A weight matrix as ops.c's layer steps take it: one of our matmul kernels (its address) and its operands."""

    _fields_ = [("fn", ctypes.c_void_p), ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("kind", ctypes.c_int32), ("mode", ctypes.c_int32)]


F32, ONE, TWO, ROWS = 0, 1, 2, 3  # Matrix.kind: f32.c's (w, x, y, ...); q4.c's (a, x, y, ..., mode); q4.c's
# (a, b, x, ...); row ranges of their own kernels (a: an array of `mode` Matrix, stacked by rows)


def matrix(fn, kind: int, shape: tuple[int, int], a: torch.Tensor, b: torch.Tensor | None = None,
           mode: int = 0) -> Matrix:
    """fn: the kernel (a ctypes function of q4.c or f32.c); a, b: its weight operands, which the caller keeps."""
    return Matrix(ctypes.cast(fn, ctypes.c_void_p).value, a.data_ptr(), None if b is None else b.data_ptr(), shape[0],
                  shape[1], kind, mode)


def rows_matrix(pieces: list[Matrix]) -> Matrix:
    """One matrix of row-range pieces (quant.Rows: wq and wk int4 above an int8 wv), each through its own kernel;
    the result keeps their array alive."""
    array = (Matrix * len(pieces))(*pieces)
    out = Matrix(None, ctypes.addressof(array), None, sum(p.n for p in pieces), pieces[0].k, ROWS, len(pieces))
    out.pieces = array
    return out


class Segment(ctypes.Structure):
    _fields_ = [("kv", ctypes.c_void_p), ("pos", ctypes.c_int64), ("t", ctypes.c_int64), ("cap", ctypes.c_int64)]


class LayerArgs(ctypes.Structure):
    """A layer as ops.c's prima_window takes it: its matrices, norms (None: the model has none), rope tables and
    attention window (0: none)."""

    _fields_ = [(n, Matrix) for n in ("wqkv", "wo", "w_gate_up", "w_down")] + [
        (n, ctypes.c_void_p) for n in ("attn_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm", "ffn_norm",
                                       "post_ffn_norm", "cos", "sin")] + [("rot", ctypes.c_int64),
                                                                          ("window", ctypes.c_int64)]


class KV(ctypes.Structure):
    _fields_ = [("kv", ctypes.c_void_p), ("cap", ctypes.c_int64)]


def available() -> bool:
    return _lib() is not None


def fits(*tensors: torch.Tensor) -> bool:
    """Whether ops.c takes these tensors as they are: float32, contiguous, and it builds here."""
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors) and available()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps) over the last dim of x [..., H], w [H] (both fit)."""
    out = torch.empty_like(x)
    _lib().prima_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return out


def attend_rows(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, pos: int, nh: int,
                window: int | None, scale: float, q_norm: torch.Tensor | None = None,
                k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """qkv [T, (nh + 2 nkv) hd] of rows at positions [pos, pos + T) -> attention [T, nh hd]: q and k rotated by the
    rope tables cos / sin [S, rot], each row's key and value written into kv [2, nkv, cap, hd] at its position, row i
    over the keys up to its own (the last `window` of them where the layer is local), as row_attention.attend_rows
    computes a row after nodes/engine/model.py's RoPE (tests/test_ops.py holds the two together). q_norm, k_norm
    [hd] (float32, contiguous): per-head RMSNorms before RoPE (Qwen3, Gemma 3), as rms_norm computes them."""
    t, (_, nkv, cap, hd) = qkv.shape[0], kv.shape
    out = torch.empty(t, nh * hd)
    if _lib().prima_attend_rows(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), out.data_ptr(), t, pos,
                                nh, nkv, hd, cos.shape[1], cap, window or 0, scale, _ptr(q_norm), _ptr(k_norm), eps,
                                torch.get_num_threads()):
        raise MemoryError(f"ops.c: no memory for the attention scores of {t} rows over {pos + t} positions")
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def attention_block(x: torch.Tensor, norms: tuple, wqkv: Matrix, wo: Matrix, w_gate_up: Matrix, segs: list,
                    cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, hd: int, window: int | None, scale: float,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (float32, contiguous) -> (h [T, H], x plus the attention, and rms_norm(h, ffn_norm) @ w_gate_up.T
    [T, 2 I]), as model.attention_stage and the gate_up product compute them. norms: the data pointers of attn_norm,
    bqkv, q_norm, k_norm, post_attn_norm, ffn_norm (0: none); segs: (kv, pos, t) in row order, each fitting
    attend_rows."""
    rows, hidden = x.shape
    h, gu = torch.empty(rows, hidden), torch.empty(rows, w_gate_up.n)
    cs = (Segment * len(segs))(*((kv.data_ptr(), pos, t, kv.shape[2]) for kv, pos, t in segs))
    attn_norm, bqkv, q_norm, k_norm, post_attn_norm, ffn_norm = norms
    if _lib().prima_attention_block(x.data_ptr(), h.data_ptr(), gu.data_ptr(), rows, hidden, attn_norm, bqkv or None,
                                    q_norm or None, k_norm or None, wqkv, wo, post_attn_norm or None, ffn_norm,
                                    w_gate_up, cs, len(segs),
                                    cos.data_ptr(), sin.data_ptr(), cos.shape[1], nh, nkv, hd, window or 0, scale, eps,
                                    torch.get_num_threads()):
        raise MemoryError(f"ops.c: no memory for a layer step of {rows} rows")
    return h, gu


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu [..., 2 I] (gate, then up: gate_up's product; fits) -> [..., I], with ops.c's own exp:
    the same bits on every path and ISA."""
    inter = gu.shape[-1] // 2
    out = torch.empty(*gu.shape[:-1], inter)
    _lib().prima_silu_mul(gu.data_ptr(), out.data_ptr(), gu.numel() // gu.shape[-1], inter, torch.get_num_threads())
    return out


def window(x: torch.Tensor, layers, spans, kvs, nseg: int, nh: int, nkv: int, hd: int, scale: float,
           eps: float) -> torch.Tensor:
    """x [T, H] (float32, contiguous) after the layers of `layers` (a LayerArgs array) in turn, each as
    attention_block, silu_mul and down_block compute it: spans, a c_int64 array of each segment's (pos, t);
    kvs, an array of each segment's KV array (one KV per layer)."""
    out = torch.empty_like(x)
    if _lib().prima_window(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], layers, len(layers), spans, kvs,
                           nseg, nh, nkv, hd, scale, eps, torch.get_num_threads()):
        raise MemoryError(f"ops.c: no memory for a window of {len(layers)} layers over {x.shape[0]} rows")
    return out


def down_block(h: torch.Tensor, a: torch.Tensor, w_down: Matrix, post_ffn_norm: int, eps: float) -> torch.Tensor:
    """h + a @ w_down.T (post_ffn_norm's data pointer, 0: none, normalising the product first), as model.down_stage."""
    out = torch.empty_like(h)
    if _lib().prima_down_block(h.data_ptr(), a.data_ptr(), out.data_ptr(), h.shape[0], w_down, post_ffn_norm or None,
                               eps, torch.get_num_threads()):
        raise MemoryError(f"ops.c: no memory for the activations of a [{h.shape[0]}, {w_down.k}] matmul")
    return out
