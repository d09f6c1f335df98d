"""int4 weights in GGUF's Q4 order multiplied through q4.c (activations as two int8 terms a group, maddubs dot
products): the int4 path for float32 activations wherever q4.c builds (AVX2 and up), where torch's float32 int4
kernel is a scalar loop. Which activation dtype a machine runs int4 in is measured (nodes/engine/dtype_choice.py):
on AVX2 this kernel in float32 wins, on AVX-512 torch's bfloat16 kernel stays where it is faster."""

import ctypes
from functools import cache

import torch

from nodes.engine.kernels.build import library

GROUP = 32  # weights per (d, m) along K, as nodes/engine/quant.py's int4


@cache
def _lib() -> ctypes.CDLL | None:
    lib = library("q4")
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.prima_q4_quantize.argtypes = [p] * 5 + [i] * 2
        lib.prima_q4_mm.argtypes = [p] * 7 + [i] * 3 + [ctypes.c_int]
        lib.prima_q4_from_torch.argtypes = [p] * 2 + [i] * 2 + [ctypes.c_int] * 3
    return lib


def available() -> bool:
    return _lib() is not None


class Q4Rows:
    """Weights [N, K]: w = d q + m per group of 32 along K (GGUF Q4_0 / Q4_1 exactly), one row's groups in a row."""

    def __init__(self, q: torch.Tensor, dm: torch.Tensor):
        # q: uint8 [N, K/2], a group's 16 bytes in GGUF's order (byte i: values i and 16 + i); dm: float16 (d, m)
        # [K/32, N, 2]
        self.q = q
        self.dm = dm.permute(1, 2, 0).contiguous()  # float16 [N, 2, K/32]: each row's d, then its m
        self.shape = (q.shape[0], q.shape[1] * 2)

    @staticmethod
    def from_values(q: torch.Tensor, dm: torch.Tensor) -> "Q4Rows":
        """From values uint8 [N, K] in [0, 16)."""
        n, k = q.shape
        v = q.view(n, k // GROUP, 2, GROUP // 2)
        return Q4Rows((v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2), dm)

    @staticmethod
    def from_torch(packed: torch.Tensor, dm: torch.Tensor, block: int, lanes: bool) -> "Q4Rows":
        """From torch's packed layout [N, K/2] of whole blocks of `block` rows (nodes/engine/quant.py Layout)."""
        n, k = packed.shape[0], packed.shape[1] * 2
        assert n % block == 0, (n, block)
        out = torch.zeros(n, k // 2, dtype=torch.uint8)
        _lib().prima_q4_from_torch(packed.contiguous().data_ptr(), out.data_ptr(), n, k, block, int(lanes),
                                   torch.get_num_threads())
        return Q4Rows(out, dm)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (float32) @ w.T -> float32 [M, N]; within 1 / 16256 of each group's largest |x| per activation
        (q4.c), so with an exact activation (an identity) the weights come back bit for bit."""
        x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        m, (n, k) = x.shape[0], self.shape
        terms = torch.empty(2, m, k, dtype=torch.int8)  # a, b
        groups = torch.empty(2, m, k // GROUP)  # step s / 128, sum of x
        y = torch.empty(m, n)
        lib = _lib()
        lib.prima_q4_quantize(x.data_ptr(), terms[0].data_ptr(), terms[1].data_ptr(), groups[0].data_ptr(),
                              groups[1].data_ptr(), m, k)
        lib.prima_q4_mm(self.q.data_ptr(), self.dm.data_ptr(), terms[0].data_ptr(), terms[1].data_ptr(),
                        groups[0].data_ptr(), groups[1].data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` de-quantized (d q + m in float32, rounded once: GGUF's values)."""
        flat = ids.reshape(-1)
        b = self.q[flat].view(len(flat), -1, GROUP // 2)
        q = torch.cat([b & 15, b >> 4], dim=-1).view(len(flat), -1).float()  # [R, K]
        d, m = (self.dm[flat, j].float().repeat_interleave(GROUP, dim=1) for j in (0, 1))
        return torch.addcmul(m, q, d).view(*ids.shape, self.shape[1])

    def nbytes(self) -> int:
        return self.q.numel() + self.dm.numel() * 2
