"""Read one weight unit (embedding, a decoder layer, or the head) of a layer store, verified."""

import ctypes
import hashlib
import json
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from nodes.engine.diskio import ChunkReader
from prima_rpc.spec.manifest import FileEntry, StoreError, read_manifest

CHUNK = 1 << 20
MAX_HEADER = 16 << 20
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8, "I8": torch.int8}


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor of a unit file lies: bytes [start, stop) of the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


class LayerStore:
    """A model directory: manifest, tokenizer and one safetensors file per unit."""

    def __init__(self, root: Path, *, verify: bool = True):
        self.root = Path(root)
        self.manifest, self.model_id = read_manifest(self.root)
        self.verify = verify
        self._verified: set[str] = set()  # units whose checksum passed once
        self._layouts: dict[str, dict[str, TensorSpan]] = {}
        self._reader: ChunkReader | None = None
        self._lock = threading.Lock()
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

    def layout(self, unit: str) -> dict[str, TensorSpan]:
        """The tensors of a unit file and their byte ranges, from its safetensors header (validated)."""
        if unit in self._layouts:
            return self._layouts[unit]
        if self.manifest.manifest_only:
            raise StoreError(f"{self.root} is a manifest-only store: it has no weights to load")
        entry = self.entry(unit)
        path = self.root / entry.path
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
                if not 2 <= n <= min(MAX_HEADER, entry.bytes - 8):
                    raise StoreError(f"{path}: not a valid safetensors file (header length {n})")
                header = json.loads(f.read(n))
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StoreError(f"{path}: not a valid safetensors file ({exc})") from None
        spans = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (a, b) = DTYPES[meta["dtype"]], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise StoreError(f"{path}: tensor {name!r} has an unsupported dtype or a malformed entry") from None
            start, stop = 8 + n + a, 8 + n + b
            size = torch.Size(shape).numel() * dtype.itemsize
            if not (8 + n <= start <= stop <= entry.bytes and stop - start == size and start % dtype.itemsize == 0):
                raise StoreError(f"{path}: tensor {name!r} bytes [{a}, {b}) do not fit its shape {list(shape)} "
                                 "or the file")
            spans[name] = TensorSpan(dtype, shape, start, stop)
        self._layouts[unit] = spans
        return spans

    def read_into(self, unit: str, targets: dict[str, torch.Tensor]) -> int:
        """Fill `targets` (one contiguous tensor per tensor of the unit, same shape, any float dtype) from the
        unit's file, bypassing the page cache; checks size and (once) sha256. Returns the bytes read."""
        return self._read(unit, targets, partial=False)

    def read_part(self, unit: str, targets: dict[str, torch.Tensor],
                  done: Callable[[str], None] = lambda name: None) -> int:
        """Fill some of the unit's tensors, reading only their bytes, in the order of `targets`, and call
        done(name) as each is complete (no checksum: the whole file's was checked when it was first read).
        Returns the bytes read."""
        return self._read(unit, targets, partial=True, done=done)

    def _read(self, unit: str, targets: dict[str, torch.Tensor], partial: bool,
              done: Callable[[str], None] = lambda name: None) -> int:
        entry = self.entry(unit)
        path = self.root / entry.path
        spans = self.layout(unit)
        if set(targets) - set(spans) or (not partial and set(spans) != set(targets)):
            raise StoreError(f"{path}: holds tensors {sorted(spans)}, expected {sorted(targets)}")
        pieces = []
        order = list(targets) if partial else sorted(spans, key=lambda name: spans[name].start)
        for name in order:
            span, t = spans[name], targets[name]
            if tuple(t.shape) != span.shape or not t.is_contiguous():
                raise StoreError(f"{path}: tensor {name!r} has shape {list(span.shape)}, expected {list(t.shape)}")
            pieces.append((name, span, t.view(-1)))
        upto = {name: span.start for name, span, _ in pieces}  # each tensor is complete from its start to here
        hasher = hashlib.sha256() if not partial and self.needs_check(unit) else None

        def sink(offset: int, chunk: torch.Tensor, n: int) -> None:
            if hasher is not None:
                hasher.update(chunk.numpy())
            for name, span, t in pieces:
                lo, hi = max(span.start, offset), min(span.stop, offset + n)
                if lo >= hi or upto[name] == span.stop:
                    continue
                es = span.dtype.itemsize
                if t.dtype == span.dtype:  # plain bytes: memmove releases the GIL and runs on one core
                    ctypes.memmove(t.data_ptr() + lo - span.start, chunk.data_ptr() + lo - offset, hi - lo)
                else:
                    src = chunk[lo - offset:hi - offset].view(span.dtype)
                    t[(lo - span.start) // es:(hi - span.start) // es].copy_(src)
                if lo <= upto[name] < hi:  # blocks shared by two ranges may bring bytes twice: count them once
                    upto[name] = hi
                    if hi == span.stop:
                        done(name)

        ranges = [(span.start, span.stop) for _, span, _ in pieces] if partial else None
        with self._lock:
            if self._reader is None:
                self._reader = ChunkReader()
            n = self._reader.read(path, entry.bytes, sink, ranges)
            self.bytes_read += n
        if hasher is not None:
            if hasher.hexdigest() != entry.sha256:
                raise StoreError(f"{path}: sha256 does not match the manifest (corrupted file)")
            self._verified.add(unit)
        return n

    def needs_check(self, unit: str) -> bool:
        """Whether the unit's next read also checks its sha256 (the first read does, when verifying)."""
        return bool(self.verify and unit not in self._verified and self.entry(unit).sha256)

    def new_tensors(self, unit: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """The unit's tensors read into fresh tensors of `dtype` (what `load` then `.to(dtype)` gives; None:
        as stored)."""
        out = {name: torch.empty(span.shape, dtype=dtype or span.dtype) for name, span in self.layout(unit).items()}
        self.read_into(unit, out)
        return out

    @property
    def read_method(self) -> str:
        return self._reader.method if self._reader else "O_DIRECT"

    @property
    def staging_bytes(self) -> int:
        return self._reader.staging_bytes if self._reader else 0

    def tokenizer_path(self) -> Path | None:
        name = self.manifest.tokenizer
        return self.root / name if name else None

