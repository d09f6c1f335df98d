"""How a KV cache stores its rows: in the compute dtype (float), or quantized as llama.cpp's q8_0 and q4_0 (int8,
int4): each head's row of one position in blocks of BLOCK values, each block with its own float16 scale.

A layer's cache is one tensor [2, nkv, S, width] whatever the dtype: float rows [.., head_dim] in the compute dtype,
quantized rows as uint8 bytes [.., row_bytes] (the codes, then the blocks' float16 scales). So slicing positions,
copying them to another cache, saving them to disk and counting their bytes work the same for every dtype; only
writing (pack) and reading (unpack) rows need the KVDtype. A row's bytes depend on that row alone: quantizing a
position gives the same bits alone and in a batch.
"""

from dataclasses import dataclass

import torch

BLOCK = 32  # values a scale covers (q8_0, q4_0); a head_dim it does not divide takes one block a row
NAMES = ("float", "int8", "int4")
CHOICES = ("auto", *NAMES)  # prima-node --kv-dtype; auto: the plan's choice (float where nothing is planned)


@dataclass(frozen=True)
class KVDtype:
    name: str  # "float", "int8" or "int4"

    @property
    def quantized(self) -> bool:
        return self.name != "float"

    def row_bytes(self, head_dim: int, compute: torch.dtype) -> int:
        """Bytes one head's K (or V) row of one position takes."""
        if not self.quantized:
            return head_dim * compute.itemsize
        codes = head_dim if self.name == "int8" else head_dim // 2
        return codes + 2 * (head_dim // _block(head_dim))

    def bytes_per_token(self, n_kv_heads: int, head_dim: int, compute: torch.dtype, layers: int = 1) -> int:
        """K and V of one position over `layers` layers."""
        return 2 * n_kv_heads * self.row_bytes(head_dim, compute) * layers

    def empty(self, n_kv_heads: int, slots: int, head_dim: int, compute: torch.dtype) -> torch.Tensor:
        """A layer's cache of `slots` positions: [2, nkv, slots, width]."""
        if not self.quantized:
            return torch.empty((2, n_kv_heads, slots, head_dim), dtype=compute)
        return torch.empty((2, n_kv_heads, slots, self.row_bytes(head_dim, compute)), dtype=torch.uint8)

    def pack(self, x: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
        """Rows x [..., head_dim] as this dtype stores them."""
        if not self.quantized:
            return x.to(compute)
        hd = x.shape[-1]
        blocks = x.float().reshape(*x.shape[:-1], hd // _block(hd), _block(hd))
        codes, scale = (_q8 if self.name == "int8" else _q4)(blocks)
        codes = codes.reshape(*x.shape[:-1], -1)
        return torch.cat([codes, scale.to(torch.float16).view(torch.uint8)], dim=-1)

    def unpack(self, rows: torch.Tensor, head_dim: int, compute: torch.dtype) -> torch.Tensor:
        """Stored rows [..., width] -> [..., head_dim] in `compute`."""
        if not self.quantized:
            return rows
        block = _block(head_dim)
        n = head_dim if self.name == "int8" else head_dim // 2
        lead = rows.shape[:-1]
        scale = rows[..., n:].contiguous().view(torch.float16).float()  # [..., blocks]
        codes = rows[..., :n]
        if self.name == "int8":
            values = codes.view(torch.int8).float()
        else:  # low nibble: the even value, high nibble: the odd one; stored + 8
            values = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*lead, head_dim).float() - 8
        x = values.reshape(*lead, head_dim // block, block) * scale.unsqueeze(-1)
        return x.reshape(*lead, head_dim).to(compute)


def _block(head_dim: int) -> int:
    return BLOCK if head_dim % BLOCK == 0 else head_dim


def _q8(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8_0: d = max|x| / 127, codes round(x / d) in [-127, 127]; as uint8 bytes."""
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return codes.view(torch.uint8), d


def _q4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0: the value of largest magnitude maps to -8 (d = it / -8), codes round(x / d) in [-8, 7], two a byte."""
    idx = blocks.abs().argmax(-1, keepdim=True)
    d = blocks.gather(-1, idx).squeeze(-1) / -8
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = (torch.round(blocks * inv.unsqueeze(-1)).clamp(-8, 7) + 8).to(torch.uint8)
    q = q.reshape(*q.shape[:-1], -1, 2)
    return (q[..., 0] | (q[..., 1] << 4)), d


def kv_dtype(name: str) -> KVDtype:
    """By name (NAMES); ValueError with the choices otherwise."""
    if name not in NAMES:
        raise ValueError(f"unknown KV dtype {name!r}: choose one of {', '.join(NAMES)}")
    return KVDtype(name)


def stored_as(kv: torch.Tensor, head_dim: int) -> KVDtype:
    """The KVDtype a layer's cache tensor holds (by its dtype and row width)."""
    if kv.dtype != torch.uint8:
        return FLOAT
    return INT8 if kv.shape[-1] == KVDtype("int8").row_bytes(head_dim, torch.uint8) else INT4


FLOAT, INT8, INT4 = KVDtype("float"), KVDtype("int8"), KVDtype("int4")
