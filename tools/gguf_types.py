"""What each GGUF tensor type becomes in a quantized store: int4 groups taken from its blocks as they are, or int8
rows from its de-quantized weights (the nearest fast format, measured in docs/quantization.md)."""

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import QK_K
from gguf.quants import Q4_K

from nodes.engine.quant import GROUP, gguf_q4

FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Types whose blocks are int4 groups of 32 with a scale and a min (w = d q + m): kept as they are.
INT4_EXACT = ("Q4_0", "Q4_1", "Q4_K")
# Types with more than 4 bits a weight, or a non-linear grid (IQ4): int8 rows of the de-quantized weights (the
# torch kernels have no int8 with group scales; int4 groups of these lose 3-6x more than int8 rows do, measured
# by tools/bench/bench_gguf_types.py).
INT8_NEAREST = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS", "F32", "F16", "BF16")


def store_format(gguf_type: str) -> str:
    """'int4' or 'int8': the format a matrix of this type takes in a store whose dtype is not forced."""
    return "int4" if gguf_type in INT4_EXACT else "int8"


def q4k_int4(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values q uint8 [N, K] and (d, m) float16 [K/32, N, 2] of a Q4_K tensor's raw blocks (uint8 [N, K/256 * 144]).

    Each super-block of 256 is 8 sub-blocks of 32, w = D q - M with D = d sc and M = dmin mn (6-bit sc, mn times
    the float16 d, dmin): exact in float32, as `gguf` computes them; stored as float16, each rounded once (relative
    error <= 2^-11, or 2^-25 absolute below float16's normal range)."""
    raw = np.ascontiguousarray(blocks).reshape(-1, 144)  # [B, 144]: d, dmin, 12 bytes of scales, 128 of nibbles
    d = raw[:, 0:2].view(np.float16).astype(np.float32)
    dmin = raw[:, 2:4].view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(raw[:, 4:16])  # [B, 8] each
    scale, low = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))  # [B, 8]
    qs = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)  # sub-block pairs
    q = torch.from_numpy((qs & 15).reshape(n, k))
    dm = torch.from_numpy(np.stack([scale, low], axis=-1).astype(np.float16).reshape(n, k // GROUP, 2))
    return q, dm.transpose(0, 1).contiguous()


def int4_blocks(gguf_type: str, blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, dm) of an INT4_EXACT tensor's blocks (nodes/engine/quant.py's Int4 layout before packing)."""
    if gguf_type == "Q4_K":
        if k % QK_K:
            raise ValueError(f"Q4_K rows of {k} values (not a multiple of {QK_K})")
        return q4k_int4(blocks, n, k)
    return gguf_q4(blocks, gguf_type, n, k)


@dataclass
class TypeReport:
    """What an import did with each GGUF type: tensors, weights, and the formats they became."""

    tensors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    weights: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    became: dict[str, set] = field(default_factory=lambda: defaultdict(set))

    def add(self, gguf_type: str, weights: int, became: str) -> None:
        self.tensors[gguf_type] += 1
        self.weights[gguf_type] += weights
        self.became[gguf_type].add(became)

    def lines(self) -> list[str]:
        """One line per GGUF type, most weights first."""
        out = []
        for t in sorted(self.tensors, key=lambda t: -self.weights[t]):
            how = " and ".join(sorted(describe(t, b) for b in self.became[t]))
            n = self.tensors[t]
            out.append(f"{t}: {n} tensor{'s' if n > 1 else ''}, {self.weights[t] / 1e6:.1f}M weights -> {how}")
        return out


def describe(gguf_type: str, became: str) -> str:
    if became == "int4":
        return "int4 (its blocks as they are)" if gguf_type in INT4_EXACT else "int4 (re-quantized)"
    if became == "int8":
        return "int8 rows (nearest)" if gguf_type not in FLOAT_TYPES else "int8 rows"
    return became
