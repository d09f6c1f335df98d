"""A layer's float32 steps between matmuls as one C call each (ops.c): RMSNorm, and a segment's RoPE + KV cache
write + one-row attention. Used where ops.c builds (x86 with AVX2 and up) for float32 activations; elsewhere, and for
other dtypes, the torch ops of nodes/engine/model.py and row_attention.py run. Callers check `fits` first."""

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
        lib.prima_attend_rows.argtypes = [p] * 5 + [i] * 8 + [f, ctypes.c_int]
        lib.prima_attend_rows.restype = ctypes.c_int
    return lib


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
                window: int | None, scale: float) -> torch.Tensor:
    """qkv [T, (nh + 2 nkv) hd] of rows at positions [pos, pos + T) -> attention [T, nh hd]: q and k rotated by the
    rope tables cos / sin [S, rot], each row's key and value written into kv [2, nkv, cap, hd] at its position, row i
    over the keys up to its own (the last `window` of them where the layer is local), as row_attention.attend_rows
    computes a row after nodes/engine/model.py's RoPE (tests/test_ops.py holds the two together)."""
    t, (_, nkv, cap, hd) = qkv.shape[0], kv.shape
    out = torch.empty(t, nh * hd)
    if _lib().prima_attend_rows(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), out.data_ptr(), t, pos,
                                nh, nkv, hd, cos.shape[1], cap, window or 0, scale, torch.get_num_threads()):
        raise MemoryError(f"ops.c: no memory for the attention scores of {t} rows over {pos + t} positions")
    return out
