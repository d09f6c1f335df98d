"""How a quantized store's matrices are laid out in its files: the format of a store, of a unit, of each layer's
matrices (a GGUF's mixed types make some layers' matrices int8 beside others' int4) and of each row range of a fused
one (a Q4_K_M layer's Q6_K wv, int8, beside its Q4_K wq and wk, int4), read from the manifest, and the format a new
store is written in. The kernels behind each format are nodes/engine/quant.py's."""

from dataclasses import dataclass, replace
from itertools import groupby
from typing import NamedTuple

import torch

from nodes.engine.quant import (
    GROUP,
    LAYOUTS,
    QUANTIZED,
    Int4,
    Int8,
    Layout,
    machine_layout,
    pack_int4,
    quantize_int4,
    quantize_int8,
)
from prima_rpc.spec.manifest import Manifest, StoreError
from prima_rpc.spec.shapes import FUSED, SHARED_FUSED

PARTS = {**FUSED, **SHARED_FUSED}  # a fused matrix -> its unit-file matrices, stacked by rows


@dataclass(frozen=True)
class Format:
    """A quantized store's matrix format: each matrix M is two tensors of its unit file, `M.qweight` and
    `M.scales` (int4: packed uint8 [N, K/2] and (d, m) float16 [K/32, N, 2]; int8: int8 [N, K] and
    float32 [N]); a fused matrix whose parts differ in format, two per piece (pieces())."""

    name: str  # int4 | int8
    layout: Layout = LAYOUTS[0]  # int4: the packing the files hold (that of the machine that wrote them)
    # int4 stores: the layer matrices held as int8 where the source's types have no int4 form (a GGUF's Q6_K
    # attn_v): fused ones whole (shapes.FUSED names) or parts of them (their unit-file names: "wv" is wqkv's v
    # rows); of one layer (layer(i)), or, of the whole store, those int8 in any layer (the widest: what a matrix
    # takes in the layer that holds it largest)
    int8: tuple[str, ...] = ()
    # int4 stores: each layer's int8 matrices (empty: `int8` in every layer, as stores written before
    # per-layer formats have it)
    layers: tuple[tuple[str, ...], ...] = ()

    def layer(self, i: int) -> "Format":
        """The format of layer i's matrices."""
        return replace(self, int8=self.layers[i], layers=()) if self.layers else self

    def matrix(self, name: str) -> "Format":
        """The format of the layer matrix `name` (of one layer: see layer()), a whole fused matrix or one part."""
        return Format("int8") if name in self.int8 else self

    def pieces(self, name: str) -> tuple["Piece", ...]:
        """Matrix `name`'s row ranges of one format each (of one layer: see layer()), in row order: the whole matrix,
        or each run of its parts (PARTS) that share a format, as `{name}.0`, `{name}.1`, ..."""
        parts, whole = PARTS.get(name, (name,)), self.matrix(name)
        runs = [(f, tuple(ps)) for f, ps in groupby(parts, key=whole.matrix)]  # int8 where its matrix or it is
        if len(runs) == 1:
            return (Piece(name, runs[0][0], parts),)
        return tuple(Piece(f"{name}.{j}", f, ps) for j, (f, ps) in enumerate(runs))

    def parts(self, shape: tuple[int, int]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        n, k = shape
        if self.name == "int4":
            return {"qweight": (torch.uint8, (n, k // 2)), "scales": (torch.float16, (k // GROUP, n, 2))}
        return {"qweight": (torch.int8, (n, k)), "scales": (torch.float32, (n,))}

    def nbytes(self, shape: tuple[int, int]) -> int:
        return sum(torch.Size(s).numel() * dt.itemsize for dt, s in self.parts(shape).values())

    def weight(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> "Int4 | Int8":
        """The kernel's weight from the two stored tensors, activations in `dtype`."""
        if self.name == "int4":
            return Int4.from_dm(qweight, scales, dtype, self.layout)
        return Int8(qweight, scales, dtype)

    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight, scales) of a float matrix [N, K]."""
        if self.name == "int4":
            q, dm = quantize_int4(w)
            return pack_int4(q, self.layout), dm
        return quantize_int8(w)

    def manifest(self) -> dict:
        if self.name != "int4":
            return {}
        if any(self.layers):
            return {"group": GROUP, "layout": self.layout.name, "int8_layers": [list(m) for m in self.layers]}
        return {"group": GROUP, "layout": self.layout.name} | ({"int8_matrices": list(self.int8)} if self.int8 else {})

    @staticmethod
    def of(dtype: str, quant: dict | None) -> "Format | None":
        """The format of a store of weight dtype `dtype` (None for float stores)."""
        if dtype not in QUANTIZED:
            return None
        quant = quant or {}
        if dtype == "int4":
            if quant.get("group", GROUP) != GROUP:
                raise ValueError(f"int4 groups of {quant.get('group')} are not supported (only {GROUP})")
            raw = quant.get("int8_layers", [])
            if not isinstance(raw, list):
                raise ValueError(f"quant.int8_layers is {raw!r}, not a list of each layer's int8 matrices")
            layers = tuple(matrices(m, "quant.int8_layers") for m in raw)
            return Format("int4", Layout.parse(quant.get("layout", LAYOUTS[0].name)),
                          matrices(quant.get("int8_matrices", []), "quant.int8_matrices") or widest(layers), layers)
        return Format("int8")


class Piece(NamedTuple):
    """Rows of a fused matrix in one format: its tensors in the unit file are `{name}.qweight`, `{name}.scales`."""

    name: str
    fmt: Format
    parts: tuple[str, ...]  # its unit-file matrices (PARTS), stacked by rows


NAMES = tuple(dict.fromkeys([*FUSED, *(p for ps in FUSED.values() for p in ps)]))  # what a manifest may call int8


def matrices(names: object, what: str) -> tuple[str, ...]:
    """A manifest's list of layer matrix names, checked (a store's manifest may come over the ring)."""
    if not isinstance(names, list) or not all(isinstance(n, str) and n in NAMES for n in names):
        raise ValueError(f"{what}: {names!r} is not a list of layer matrices or their parts ({', '.join(NAMES)})")
    return tuple(names)


def widest(layers: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """The matrices int8 in any of `layers` (each layer's int8 matrices), in their first layer's order."""
    return tuple(dict.fromkeys(m for layer in layers for m in layer))


def writing_format(dtype: str, layers: tuple[tuple[str, ...], ...] = ()) -> "Format | None":
    """The format a new store of `dtype` is written in on this machine (int4: each layer's int8 matrices
    `layers` aside)."""
    if dtype != "int4":
        return Format.of(dtype, None)
    alike = len(set(layers)) <= 1  # one format per matrix in every layer: as stores before per-layer formats
    return Format(dtype, machine_layout(), widest(layers), () if alike else layers)


def weight_format(manifest: Manifest, unit: str | None = None) -> Format | None:
    """The Format of a quantized store's matrices (of one unit's, which may differ: an int4 store keeps an
    embedding that is not int4 in its source as int8); None for float stores."""
    dtype = (manifest.units()[unit].format if unit else "") or manifest.dtype
    try:
        fmt = Format.of(dtype, manifest.quant)
    except ValueError as exc:
        raise StoreError(f"store {manifest.name!r}: {exc}") from None
    if fmt and fmt.layers and len(fmt.layers) != manifest.config.n_layers:
        raise StoreError(f"store {manifest.name!r}: quant.int8_layers lists {len(fmt.layers)} layers for "
                         f"{manifest.config.n_layers}")
    return fmt
