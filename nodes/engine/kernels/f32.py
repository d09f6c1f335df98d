"""float32 weights times few float32 activation rows through f32.c (decode steps, verify frames): each weight row
read once for all rows, every output summed in one fixed order whatever rows share the call. Used where f32.c
builds (x86 with AVX2 and up, aarch64); elsewhere torch's GEMMs of PAIR columns (nodes/engine/quant.py)."""

import ctypes
from functools import cache

import torch

from nodes.engine.kernels import ops
from nodes.engine.kernels.build import library


@cache
def _lib() -> ctypes.CDLL | None:
    lib = library("f32")
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.prima_f32_mm.argtypes = [p] * 3 + [i] * 3 + [ctypes.c_int]
        lib.prima_f32_mm.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T for w [N, K], both float32 and contiguous."""
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n)
    _lib().prima_f32_mm(w.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def matrix(w: torch.Tensor) -> ops.Matrix:
    """w (float32, contiguous, kept by the caller) as ops.c's layer steps take it."""
    return ops.matrix(_lib().prima_f32_mm, ops.F32, tuple(w.shape), w)
