"""Prefixes on disk: a node writes the KV of each cached prompt prefix, one file per window, so that after a restart
(or a re-plan that keeps the window) a request loads it instead of prefilling.

A file's name is a hash of what makes its content valid: the model, the window's layers, the KV dtype and the
prefix key. A re-plan that moves a window looks for other names, so it loses only that window's prefixes. A file
is its header (JSON), the tensors' raw bytes (any dtype: the cache's rows as they are held) and a BLAKE2b digest
of both; one whose digest, header or shapes do not match is deleted and reported missing, never used. Writes go to
a temporary file renamed into place (nothing half-written is ever read), on a thread of their own. The directory
is bounded: least recently used files (by mtime, which a read renews) go first; nodes on one machine may share it.
"""

import hashlib
import json
import math
import os
import struct
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import structlog
import torch

MAGIC = b"PRIMAKV1"
DIGEST = 32
SUFFIX = ".kv"
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                                     torch.uint8, torch.int16, torch.int32)}
DEFAULT_BOUND = 1 << 30


class PrefixDisk:
    """One node's prefix files of one model and KV dtype, in `directory`, at most `bound` bytes all together."""

    def __init__(self, directory: Path, bound: int, model_id: str, kv_dtype: str, log=None):
        self.directory, self.bound, self.model_id, self.kv_dtype = Path(directory), bound, model_id, kv_dtype
        self.log = log or structlog.get_logger()
        self.directory.mkdir(parents=True, exist_ok=True)
        clean_temporaries(self.directory)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="prefix-disk")
        self._pending: list[Future] = []

    def tag(self, window: tuple[int, int]) -> str:
        """What a window's files must match: the model, the window's layers and the KV dtype."""
        text = f"{self.model_id}|{window[0]}-{window[1]}|{self.kv_dtype}"
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def path(self, window: tuple[int, int], key: str) -> Path:
        return self.directory / f"{self.tag(window)}-{key}{SUFFIX}"

    def has(self, windows, key: str) -> bool:
        return all(self.path(w, key).exists() for w in windows)

    def held_bytes(self, windows) -> int:
        """Bytes of this node's files (its windows' tags) on disk."""
        tags = {self.tag(w) for w in windows}
        return sum(size for path, size, _ in self._files() if path.name.split("-", 1)[0] in tags)

    # ------------------------------------------------------------------ writing

    def write(self, window: tuple[int, int], key: str, length: int, kv: dict[int, torch.Tensor]) -> None:
        """Queue the file of `key`'s positions [0, length) of the window's layers kv (layer -> [2, nkv, L, ...]),
        which nobody writes to afterwards (the prefix cache's own copy)."""
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._writer.submit(self._write, window, key, length, kv))

    def flush(self) -> None:
        """Wait for the writes queued so far."""
        for f in self._pending:
            f.exception()
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)

    def _write(self, window: tuple[int, int], key: str, length: int, kv: dict[int, torch.Tensor]) -> None:
        try:
            data = self._encode(window, key, length, kv)
            if len(data) > self.bound:
                return
            self._evict(self.bound - len(data))
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path(window, key))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:  # a full or read-only disk costs the copy, never the request
            self.log.warning("prefix not written to disk", key=key[:12], error=str(exc))

    def _encode(self, window: tuple[int, int], key: str, length: int, kv: dict[int, torch.Tensor]) -> bytes:
        layers = sorted(kv)
        tensors = [kv[i][:, :, :length].contiguous() for i in layers]
        header = json.dumps({"model": self.model_id, "window": list(window), "kv_dtype": self.kv_dtype, "key": key,
                             "length": length, "layers": layers,
                             "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]})
        parts = [MAGIC, struct.pack("<I", len(header)), header.encode()]
        parts += [t.view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in tensors]
        body = b"".join(parts)
        return body + hashlib.blake2b(body, digest_size=DIGEST).digest()

    def _files(self) -> list[tuple[Path, int, float]]:
        out = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(SUFFIX):
                try:
                    st = entry.stat()
                except FileNotFoundError:  # another node evicted it meanwhile
                    continue
                out.append((Path(entry.path), st.st_size, st.st_mtime))
        return out

    def _evict(self, room: int) -> None:
        """Delete the least recently used files until the rest take at most `room` bytes."""
        files = sorted(self._files(), key=lambda f: f[2])
        total = sum(size for _, size, _ in files)
        for path, size, _ in files:
            if total <= room:
                break
            path.unlink(missing_ok=True)
            total -= size

    # ------------------------------------------------------------------ reading

    def read(self, window: tuple[int, int], key: str) -> tuple[int, dict[int, torch.Tensor]] | None:
        """(length, layer -> tensor) of the window's file of `key`; None if there is none or it is not valid (a
        broken one is deleted)."""
        path = self.path(window, key)
        try:
            data = path.read_bytes()
        except OSError:  # none, or unreadable: the same to the request (it prefills)
            return None
        try:
            got = self._decode(data, window, key)
        except (ValueError, KeyError, TypeError, struct.error, RuntimeError) as exc:
            self.log.warning("prefix file ignored", path=str(path), reason=str(exc))
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used
        except FileNotFoundError:
            pass
        return got

    def _decode(self, data: bytes, window: tuple[int, int], key: str) -> tuple[int, dict[int, torch.Tensor]]:
        body, digest = data[:-DIGEST], data[-DIGEST:]
        if len(data) < len(MAGIC) + 4 + DIGEST or hashlib.blake2b(body, digest_size=DIGEST).digest() != digest:
            raise ValueError("checksum mismatch")
        if body[:len(MAGIC)] != MAGIC:
            raise ValueError("not a prefix file")
        (n,) = struct.unpack_from("<I", body, len(MAGIC))
        start = len(MAGIC) + 4
        head = json.loads(body[start:start + n])
        expected = {"model": self.model_id, "window": list(window), "kv_dtype": self.kv_dtype, "key": key}
        if any(head[k] != v for k, v in expected.items()):
            raise ValueError("written for another model, window, KV dtype or key")
        length, layers = int(head["length"]), [int(i) for i in head["layers"]]
        if layers != list(range(window[0], window[1])):
            raise ValueError("its layers are not the window's")
        payload, offset, kv = memoryview(body)[start + n:], 0, {}
        for i, (dtype, shape) in zip(layers, head["tensors"], strict=True):
            shape, kind = [int(s) for s in shape], DTYPES[dtype]
            size = math.prod(shape) * kind.itemsize
            if len(shape) < 3 or shape[2] != length or min(shape) < 0 or offset + size > len(payload):
                raise ValueError("a tensor's shape does not match the file")
            t = torch.empty(shape, dtype=kind)
            if size:
                t.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(payload[offset:offset + size]),
                                                                     dtype=torch.uint8))
            kv[i], offset = t, offset + size
        if offset != len(payload):
            raise ValueError("trailing bytes")
        return length, kv


def clean_temporaries(directory: Path, older_than_s: float = 600.0) -> None:
    """Temporary files a stopped writer left (never renamed into place, so never read); a younger one may be another
    node's write in progress."""
    now = time.time()
    for path in Path(directory).glob(".tmp-*"):
        try:
            if now - path.stat().st_mtime > older_than_s:
                path.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
