"""int4 weights in GGUF's Q4 order multiplied through q4.c (activations quantized to int8, integer dot products
per instruction set): the int4 path for float32 activations wherever q4.c builds (x86 AVX2 and up, aarch64 NEON),
where torch's float32 int4 kernel is a scalar loop. Which activation dtype a machine runs int4 in is measured
(nodes/engine/dtype_choice.py).
"""

import ctypes
import os
from functools import cache

import torch

from nodes.engine.kernels import ops
from nodes.engine.kernels.build import chosen, library

GROUP = 32  # weights per (d, m) along K, as nodes/engine/quant.py's int4
# How activations are quantized (q4.c): "exact", two int8 terms a value (~14 bits; an exact activation gives the
# weights back bit for bit), or "q8", ggml's Q8_0 (one int8 term a value, a float16 scale per 32: llama.cpp's
# numerics, half the dot products). PRIMA_INT4_ACTIVATIONS picks one; exact by default: q8 was 10-25 % faster a
# matmul on AVX-512 (0-12 % a decode on AVX2, whose tiles take both modes as int16) but less exact (SmolLM2 Q4_1 lost
# "Paris" as llama.cpp does; docs/quantization.md).
MODES = {"exact": 0, "q8": 1}
MODE_ENV = "PRIMA_INT4_ACTIVATIONS"
TILE_BYTES = 160  # q4.c: a tile's group, 8 rows of 32 values (128 bytes), their d and their m (float16)
# The most an activation may be off in each mode, over its group's largest |x| (q4.c's header): exact 1 / 16256;
# q8 1 / 254 from the rounding plus 127 times the float16 rounding of its scale (2^-11 of it, 2^-25 below 2^-14).
BOUND = {"exact": 1 / 16256, "q8": 1 / 254 + 2.0 ** -11 + 2.0 ** -20}  # (2^-20: x 127 / max |x| rounds in float32)
TINY_SCALE = 127 * 2.0 ** -25  # q8: the absolute part of the bound where the scale is a float16 subnormal


def mode() -> str:
    """The activation mode of this process (PRIMA_INT4_ACTIVATIONS, else exact)."""
    name = os.environ.get(MODE_ENV, "exact").strip().lower()
    if name not in MODES:
        raise ValueError(f"{MODE_ENV}={name!r}: expected one of {', '.join(MODES)}")
    return name


@cache
def _lib() -> ctypes.CDLL | None:
    lib = library("q4")
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        if lib.prima_q4_tiles():  # AVX2 builds: weights in tiles of rows (q4.c), else one row after another
            lib.prima_q4_tile.argtypes = [p] * 3 + [i] * 2 + [ctypes.c_int]
            lib.prima_q4_tiled_mm.argtypes = [p] * 3 + [i] * 3 + [ctypes.c_int] * 2
            lib.prima_q4_tiled_mm.restype = ctypes.c_int
            lib.prima_int8_tile.argtypes = [p] * 2 + [i] * 2 + [ctypes.c_int]
            lib.prima_int8_tiled_mm.argtypes = [p] * 4 + [i] * 3 + [ctypes.c_int] * 2
            lib.prima_int8_tiled_mm.restype = ctypes.c_int
            lib.prima_int8_tiled_rows.argtypes = [p] * 3 + [i, p, i, i]
            lib.prima_int8_tiled_rows.restype = ctypes.c_int
        else:
            lib.prima_q4_mm.argtypes = [p] * 4 + [i] * 3 + [ctypes.c_int] * 2
            lib.prima_q4_mm.restype = ctypes.c_int
        lib.prima_int8_mm.argtypes = [p] * 4 + [i] * 3 + [ctypes.c_int] * 2
        lib.prima_int8_mm.restype = ctypes.c_int
        lib.prima_q4_from_torch.argtypes = [p] * 2 + [i] * 2 + [ctypes.c_int] * 3
    return lib


def available() -> bool:
    return _lib() is not None


def build() -> str | None:
    """The build q4.c runs here and its activation mode (e.g. "avx512vnni q8"), None where it has none."""
    found = chosen("q4")
    return None if found is None else f"{found[0]} {mode()}"


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32) @ (q * scale[:, None]).T for int8 weights q [N, K] and float32 row scales [N] (quant.py's
    Int8): activations quantized as for int4 (mode()), the same bound; exact mode and an exact activation give
    q * scale back bit for bit. torch's int8 kernel is a scalar loop for float32 activations."""
    x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    (m, k), n = x.shape, q.shape[0]
    y = torch.empty(m, n)
    if _lib().prima_int8_mm(q.data_ptr(), scale.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, MODES[mode()],
                            torch.get_num_threads()):
        raise MemoryError(f"q4.c: no memory for the activations of a [{m}, {k}] matmul")
    return y


def int8_matrix(q: torch.Tensor, scale: torch.Tensor) -> ops.Matrix:
    """int8_mm's weights as ops.c's layer steps take them (q contiguous, scale float32: both kept by the caller)."""
    return ops.matrix(_lib().prima_int8_mm, ops.TWO, tuple(q.shape), q, scale, MODES[mode()])


def tiles() -> int:
    """Rows a tile of q4.c's build here (8 on AVX2: weights kept in tiles of rows), 0 where it keeps rows."""
    return _lib().prima_q4_tiles() if available() else 0


class Int8Tiles:
    """int8 weights [N, K] (one float32 scale a row) in q4.c's tiles of rows (AVX2 builds): the int8 path for float32
    activations there, one stream a tile like the int4 tiles."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        (n, k), self.tile = q.shape, tiles()
        self.shape, self.scale, self.mode = (n, k), scale.float().contiguous(), MODES[mode()]  # as Q4Rows: fixed
        self.tiles = torch.empty(-(-n // self.tile), k // GROUP, self.tile * GROUP, dtype=torch.int8)
        _lib().prima_int8_tile(q.contiguous().data_ptr(), self.tiles.data_ptr(), n, k, torch.get_num_threads())

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        (m, k), n = x.shape, self.shape[0]
        y = torch.empty(m, n)
        if _lib().prima_int8_tiled_mm(self.tiles.data_ptr(), self.scale.data_ptr(), x.data_ptr(), y.data_ptr(), m, n,
                                      k, self.mode, torch.get_num_threads()):
            raise MemoryError(f"q4.c: no memory for the activations of a [{m}, {k}] matmul")
        return y

    def matrix(self) -> ops.Matrix:
        return ops.matrix(_lib().prima_int8_tiled_mm, ops.TWO, self.shape, self.tiles, self.scale, self.mode)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` (any shape) [*ids.shape, K], each value times its row's scale (one C call)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(len(flat), self.shape[1])
        if _lib().prima_int8_tiled_rows(self.tiles.data_ptr(), self.scale.data_ptr(), flat.data_ptr(), len(flat),
                                        out.data_ptr(), *self.shape):
            raise IndexError(f"row ids must lie in [0, {self.shape[0]})")
        return out.view(*ids.shape, self.shape[1])


class Q4Rows:
    """Weights [N, K]: w = d q + m per group of 32 along K (GGUF Q4_0 / Q4_1 exactly), in the layout the build
    multiplies fastest: one row's groups in a row (AVX-512, NEON), or tiles of rows, each group's values and scales of 8
    rows together (AVX2; q4.c says why)."""

    def __init__(self, q: torch.Tensor, dm: torch.Tensor):
        # q: uint8 [N, K/2], a group's 16 bytes in GGUF's order (byte i: values i and 16 + i); dm: float16 (d, m)
        # [K/32, N, 2]
        self.shape = (q.shape[0], q.shape[1] * 2)
        self.mode = MODES[mode()]
        rows_dm = dm.permute(1, 2, 0).contiguous()  # float16 [N, 2, K/32]: each row's d, then its m
        self.tile = _lib().prima_q4_tiles()
        if self.tile:
            n, k = self.shape
            self.tiles = torch.empty(-(-n // self.tile), k // GROUP, TILE_BYTES, dtype=torch.uint8)
            _lib().prima_q4_tile(q.contiguous().data_ptr(), rows_dm.data_ptr(), self.tiles.data_ptr(), n, k,
                                 torch.get_num_threads())
        else:
            self.q, self.dm = q, rows_dm

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
        """x [M, K] (float32) @ w.T -> float32 [M, N]; each activation within BOUND[mode()] of its group's largest
        |x| (q4.c), so in exact mode an exact activation (an identity) gives the weights back bit for bit."""
        x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        m, (n, k) = x.shape[0], self.shape
        y = torch.empty(m, n)
        if self.tile:
            failed = _lib().prima_q4_tiled_mm(self.tiles.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, self.mode,
                                              torch.get_num_threads())
        else:
            failed = _lib().prima_q4_mm(self.q.data_ptr(), self.dm.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k,
                                        self.mode, torch.get_num_threads())
        if failed:
            raise MemoryError(f"q4.c: no memory for the activations of a [{m}, {k}] matmul")
        return y

    def matrix(self) -> ops.Matrix:
        """These weights as ops.c's layer steps take them (mm's kernel and operands)."""
        if self.tile:
            return ops.matrix(_lib().prima_q4_tiled_mm, ops.ONE, self.shape, self.tiles, mode=self.mode)
        return ops.matrix(_lib().prima_q4_mm, ops.TWO, self.shape, self.q, self.dm, self.mode)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` de-quantized (d q + m in float32, rounded once: GGUF's values)."""
        flat = ids.reshape(-1)
        q, d, m = self._tiled_rows(flat) if self.tile else self._plain_rows(flat)
        d, m = (v.float().repeat_interleave(GROUP, dim=1) for v in (d, m))
        return torch.addcmul(m, q.float(), d).view(*ids.shape, self.shape[1])

    def _plain_rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self.q[flat].view(len(flat), -1, GROUP // 2)
        return torch.cat([b & 15, b >> 4], dim=-1).view(len(flat), -1), self.dm[flat, 0], self.dm[flat, 1]

    def _tiled_rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Values [R, K] and d, m [R, G] of rows `flat` out of their tiles (q4.c's prima_q4_tile)."""
        r, t, j = len(flat), flat // self.tile, flat % self.tile
        blocks = self.tiles[t]  # [R, G, TILE_BYTES]
        values = blocks[:, :, :GROUP * self.tile // 2].reshape(r, -1, 8, self.tile, 2)[torch.arange(r), :, :, j]
        q = torch.cat([(values & 15).flatten(2), (values >> 4).flatten(2)], dim=-1)  # [R, G, 32] in value order
        scales = blocks[:, :, GROUP * self.tile // 2:].contiguous().view(torch.float16).view(r, -1, 2, self.tile)
        return q.reshape(r, -1), scales[torch.arange(r), :, 0, j], scales[torch.arange(r), :, 1, j]

    def nbytes(self) -> int:
        return self.tiles.numel() if self.tile else self.q.numel() + self.dm.numel() * 2
