"""Write a layer store atomically: units go to a temporary directory renamed into place at the end."""

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save

from nodes.engine.formats import Format
from nodes.engine.quant import BITS
from prima_rpc.spec.manifest import MANIFEST, FileEntry, Manifest, ModelConfig, StoreError, expert_unit

# A quantized store's matrices: fused as the model multiplies by them, from a float unit's tensors (in order).
FUSED = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"), "w_down": ("w_down",),
         "ws_gate_up": ("ws_gate", "ws_up"), "ws_down": ("ws_down",), "embed": ("embed",), "output": ("output",)}

UNIT_FILES = {"embed": "embed.safetensors", "head": "head.safetensors"}


def outer_format(fmt: Format) -> Format:
    """The embedding's and output projection's format from float weights: int8 in int4 stores (int4 groups
    cost SmolLM2 "Paris": 9 % of the embedding's norm, int8 rows 1.2 %)."""
    return Format("int8") if fmt.name == "int4" else fmt


def quantize_unit(tensors: dict[str, torch.Tensor], fmt: Format) -> tuple[dict[str, torch.Tensor], str]:
    """A float unit's tensors as a quantized store holds them (matrices fused and quantized; norms, biases and a
    mixture's router and shared-expert gate float32), and the unit's format."""
    matrices = {f"{p}.weight" for parts in FUSED.values() for p in parts}
    out = {k: v.float() for k, v in tensors.items() if k not in matrices}
    used = fmt
    for fused, parts in FUSED.items():
        if f"{parts[0]}.weight" in tensors:
            used = outer_format(fmt) if fused in ("embed", "output") else fmt
            q, scales = used.encode(torch.cat([tensors[f"{p}.weight"] for p in parts]))
            out[f"{fused}.qweight"], out[f"{fused}.scales"] = q, scales
    return out, used.name


def unit_file(unit: str) -> str:
    if unit in UNIT_FILES:
        return UNIT_FILES[unit]
    parts = unit.split(".")  # layer.{i}, or layer.{i}.expert.{e} (manifest.expert_unit)
    expert = f"_expert_{int(parts[3]):03d}" if len(parts) == 4 else ""
    return f"layer_{int(parts[1]):03d}{expert}.safetensors"


class StoreWriter:
    """Collects units one at a time (never the whole model in memory); `finish` publishes the store."""

    def __init__(self, out: Path, *, overwrite: bool = False):
        self.out = Path(out)
        if self.out.exists() and not overwrite:
            raise StoreError(f"{self.out} already exists")
        self.overwrite = overwrite
        self.tmp = self.out.with_name(f".{self.out.name}.partial-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.entries: dict[str, FileEntry] = {}

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Whatever happened, no half-written store is left under the final name.
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write_unit(self, unit: str, tensors: dict[str, torch.Tensor], fmt: str = "") -> FileEntry:
        """fmt: the unit's weight format when it is not the store's dtype."""
        data = save({k: v.contiguous() for k, v in tensors.items()})
        return self.write_raw(unit, data, fmt)

    def write_raw(self, unit: str, data: bytes, fmt: str = "") -> FileEntry:
        name = unit_file(unit)
        self.add_file(name, data)
        entry = FileEntry(path=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), format=fmt)
        self.entries[unit] = entry
        return entry

    def add_file(self, name: str, data: bytes) -> None:
        with open(self.tmp / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def finish(self, *, name: str, config: ModelConfig, dtype: str, bits_per_weight: float | None = None,
               manifest_only: bool = False, **extra) -> Manifest:
        entries = {u: replace(e, format=e.format or dtype) for u, e in self.entries.items()}  # every unit: the store's
        try:
            layers = tuple(entries[f"layer.{i}"] for i in range(config.n_layers))
            embed, head = entries["embed"], entries["head"]
            experts = tuple(tuple(entries[expert_unit(i, e)] for e in range(config.n_experts))
                            for i in range(config.n_layers)) if config.moe else ()
        except KeyError as exc:
            raise StoreError(f"store is incomplete: unit {exc} was never written") from None
        if bits_per_weight is None:
            bits_per_weight = BITS.get(dtype) or torch.finfo(getattr(torch, dtype)).bits
        bits = bits_per_weight
        manifest = Manifest(name=name, config=config, dtype=dtype, bits_per_weight=bits, embed=embed,
                            layers=layers, head=head, experts=experts, manifest_only=manifest_only, **extra)
        self.add_file(MANIFEST, json.dumps(manifest.to_json(), indent=1).encode())
        self.out.parent.mkdir(parents=True, exist_ok=True)
        old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
        if self.out.exists():  # overwrite: move the old store aside so a complete one is always in place
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        shutil.rmtree(old, ignore_errors=True)
        return manifest
