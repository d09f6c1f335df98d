"""Read one weight unit (embedding, a decoder layer, or the head) of a layer store, verified."""

import hashlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from nodes.config import FileEntry, StoreError, read_manifest

CHUNK = 1 << 20


class LayerStore:
    """A model directory: manifest, tokenizer and one safetensors file per unit."""

    def __init__(self, root: Path, *, verify: bool = True):
        self.root = Path(root)
        self.manifest, self.model_id = read_manifest(self.root)
        self.verify = verify
        self._verified: set[str] = set()  # units whose checksum passed once
        self.bytes_read = 0

    @property
    def config(self):
        return self.manifest.config

    def entry(self, unit: str) -> FileEntry:
        try:
            return self.manifest.units()[unit]
        except KeyError:
            raise StoreError(f"unknown unit {unit!r} in {self.root}") from None

    def read_bytes(self, unit: str) -> bytes:
        """The unit's file, checked against the manifest's size and (once) its sha256."""
        if self.manifest.manifest_only:
            raise StoreError(f"{self.root} is a manifest-only store: it has no weights to load")
        entry = self.entry(unit)
        path = self.root / entry.path
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror}") from None
        self.bytes_read += len(data)
        if len(data) != entry.bytes:
            raise StoreError(f"{path}: {len(data)} bytes, manifest says {entry.bytes} (truncated or replaced)")
        if self.verify and unit not in self._verified and entry.sha256:
            if hashlib.sha256(data).hexdigest() != entry.sha256:
                raise StoreError(f"{path}: sha256 does not match the manifest (corrupted file)")
            self._verified.add(unit)
        return data

    def load(self, unit: str) -> dict[str, torch.Tensor]:
        """The tensors of one unit; reads only that unit's file."""
        data = self.read_bytes(unit)
        try:
            return load(data)
        except SafetensorError as exc:
            raise StoreError(f"{self.root / self.entry(unit).path}: not a valid safetensors file ({exc})") from None

    def tokenizer_path(self) -> Path | None:
        name = self.manifest.tokenizer
        return self.root / name if name else None

