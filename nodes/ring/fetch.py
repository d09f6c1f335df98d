"""Weights over the ring: serve a store's files in chunks (Control.Fetch) and fetch them into a cache.

A node that lacks the units of its windows fetches the manifest, the tokenizer and exactly those unit files
from the head or any member that has them, into `CACHE/<model_id>/`. Every file is written as NAME.part and
renamed once its size and sha256 match the manifest; an interrupted transfer resumes from the .part bytes,
and complete files are reused on the next start. Names are checked before anything is written: nothing
lands outside the cache directory.
"""

import asyncio
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath

import grpc

from nodes.engine.store import LayerStore
from prima_rpc.channel import aio_channel, metadata
from prima_rpc.spec.manifest import MANIFEST, FileEntry, Manifest, StoreError
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc

CHUNK = 1 << 20  # bytes per FileChunk (well under the channel's message limit)
MAX_SERVING = 2  # transfers one node serves at once; more wait (a node's disk and link are shared)
MAX_TOKENIZER = 64 << 20
MODEL_ID = re.compile(r"[0-9a-f]{64}")
PART = ".part"
RETRIES = 2  # per file: a transfer whose sha256 does not match is discarded and fetched again once

def served_path(store: LayerStore, name: str) -> Path:
    """The file of `store` that Fetch serves under `name` (a manifest name, never a path)."""
    if name == "manifest":
        return store.root / MANIFEST
    if name == "tokenizer":
        if not store.manifest.tokenizer:
            raise StoreError("this store has no tokenizer")
        return store.root / safe_name(store.manifest.tokenizer)
    if store.manifest.manifest_only:
        raise StoreError("this node's store is manifest-only: it has no weights to serve")
    return store.root / safe_name(store.entry(name).path)


def read_chunks(path: Path, offset: int, chunk: int = CHUNK) -> Iterator[tuple[bytes, int]]:
    """(data, file size) from `offset` to the end."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if offset > size:
            raise StoreError(f"offset {offset} is past the end of {path.name} ({size} bytes)")
        f.seek(offset)
        while data := f.read(chunk):
            yield data, size


def safe_name(name: str) -> str:
    """A relative path inside a store: no absolute path, no `..`, no backslashes or empty parts."""
    p = PurePosixPath(name)
    if (not name or "\\" in name or "\0" in name or p.is_absolute() or any(part in ("", ".", "..") for part in
                                                                            name.split("/"))):
        raise StoreError(f"the manifest names {name[:80]!r}: not a relative path inside the store (refused)")
    return name


def cache_dir(cache: Path, model_id: str) -> Path:
    if not MODEL_ID.fullmatch(model_id):
        raise StoreError(f"model_id must be 64 hex digits, got {model_id[:80]!r}")
    return Path(cache) / model_id


def needed_units(store: LayerStore | None, units: Iterable[str]) -> list[str]:
    """Units whose files `store` lacks (missing, or not their manifest size)."""
    if store is None:
        return list(units)
    missing = []
    for unit in units:
        entry = store.entry(unit)
        path = store.root / entry.path
        if not (path.is_file() and path.stat().st_size == entry.bytes):
            missing.append(unit)
    return missing


class Fetcher:
    """Fetches files of one model from `sources` (tried in order) into CACHE/<model_id>/.

    progress(done, total, name) after each chunk; `fetched` counts the bytes that came over the wire."""

    def __init__(self, cache: Path, model_id: str, sources: list[str], token: str | None,
                 progress: Callable[[int, int, str], None] = lambda done, total, name: None):
        self.root = cache_dir(cache, model_id)
        self.model_id = model_id
        self.sources = [s for s in dict.fromkeys(sources) if s]
        if not self.sources:
            raise StoreError("no node to fetch the model from (the ring's head is not known yet)")
        self.md = metadata(token)
        self.progress = progress
        self.fetched = 0
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def store(self, units: Iterable[str], head: bool) -> LayerStore:
        """The cache's store, holding the manifest, (head) the tokenizer, and `units`, each verified."""
        self.root.mkdir(parents=True, exist_ok=True)
        await self._manifest()
        store = LayerStore(self.root)
        entries = {u: store.entry(u) for u in units}
        for entry in entries.values():
            safe_name(entry.path)
        todo = {u: e for u, e in entries.items() if not self._complete(e)}
        self._check_space(todo.values())
        total, done = sum(e.bytes for e in todo.values()), 0
        if store.manifest.tokenizer:  # every node gets it: cheap, and a member may become the head
            await self._tokenizer(safe_name(store.manifest.tokenizer))
        for unit, entry in todo.items():
            await self._file(unit, entry, lambda n, unit=unit, base=done: self.progress(base + n, total, unit))
            done += entry.bytes
        return store

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    # ------------------------------------------------------------------ files

    async def _manifest(self) -> None:
        path = self.root / MANIFEST
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == self.model_id:
            return
        data = await self._whole("manifest", 1 << 20)
        if hashlib.sha256(data).hexdigest() != self.model_id:
            raise StoreError("the fetched manifest does not match the ring's model_id (refused)")
        tmp = path.with_name(MANIFEST + PART)
        tmp.write_bytes(data)
        try:
            read_manifest_from(tmp)
        except StoreError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(path)

    async def _tokenizer(self, name: str) -> None:
        path = self.root / name
        if path.is_file():
            return
        data = await self._whole("tokenizer", MAX_TOKENIZER)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + PART)
        tmp.write_bytes(data)
        tmp.replace(path)

    def _complete(self, entry: FileEntry) -> bool:
        path = self.root / entry.path
        return path.is_file() and path.stat().st_size == entry.bytes

    def _check_space(self, entries: Iterable[FileEntry]) -> None:
        need = 0
        for e in entries:
            part = self.root / (e.path + PART)
            need += e.bytes - (part.stat().st_size if part.is_file() else 0)
        free = shutil.disk_usage(self.root).free
        if need > free:
            raise StoreError(f"fetching needs {need / 2**20:.0f} MiB but {self.root} has {free / 2**20:.0f} MiB free")

    async def _file(self, unit: str, entry: FileEntry, progress: Callable[[int], None]) -> None:
        """Fetch one unit into NAME.part (resuming what is there), verify, rename."""
        path = self.root / entry.path
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + PART)
        last = None
        for _ in range(RETRIES):
            have = part.stat().st_size if part.is_file() else 0
            if have > entry.bytes:
                part.unlink()
                have = 0
            hasher = hashlib.sha256()
            if have:  # the bytes already here count towards the checksum (GBs: off the event loop)
                await asyncio.to_thread(_hash_into, hasher, part)
            source = await self._stream(unit, have, entry.bytes, part, hasher, progress)
            if hasher.hexdigest() == entry.sha256 or not entry.sha256:
                part.replace(path)
                return
            part.unlink()  # bad bytes (corrupted on the wire, on this disk, or served so): fetch it anew
            last = f"{entry.path} from {source}: sha256 does not match the manifest (file discarded)"
        raise StoreError(last)

    async def _stream(self, name: str, offset: int, size: int, part: Path, hasher, progress) -> str:
        """Append `name` from `offset` to `part` from the first source that serves it; returns that source."""
        errors = []
        for source in self.sources:
            try:
                with open(part, "ab") as f:
                    got = offset
                    async for chunk in self._stub(source).Fetch(
                            pb.FetchRequest(model_id=self.model_id, name=name, offset=got), metadata=self.md):
                        if chunk.total_bytes != size or got + len(chunk.data) > size:
                            raise StoreError(f"{source} serves {name} ({part.name.removesuffix('.part')}) with "
                                             f"{chunk.total_bytes} bytes, the manifest says {size}")
                        await asyncio.to_thread(_append, f, hasher, chunk.data)  # disk and sha256 off the loop
                        got += len(chunk.data)
                        self.fetched += len(chunk.data)
                        progress(got)
                if got == size:
                    return source
                errors.append(f"{source}: ended after {got} of {size} bytes")
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{source}: {exc.code().name}: {exc.details()}")
            offset = part.stat().st_size  # another source resumes where this one stopped
        raise StoreError(f"cannot fetch {name}: " + "; ".join(errors))

    async def _whole(self, name: str, limit: int) -> bytes:
        errors = []
        for source in self.sources:
            try:
                data = bytearray()
                async for chunk in self._stub(source).Fetch(pb.FetchRequest(model_id=self.model_id, name=name),
                                                            metadata=self.md):
                    data += chunk.data
                    if len(data) > limit or chunk.total_bytes > limit:
                        raise StoreError(f"{source} serves a {name} over {limit} bytes (refused)")
                self.fetched += len(data)
                return bytes(data)
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{source}: {exc.code().name}: {exc.details()}")
        raise StoreError(f"cannot fetch the {name}: " + "; ".join(errors))

    def _stub(self, address: str) -> rpc.ControlStub:
        if address not in self._channels:
            self._channels[address] = aio_channel(address)
        return rpc.ControlStub(self._channels[address])


def _hash_into(hasher, path: Path) -> None:
    with open(path, "rb") as f:
        while data := f.read(CHUNK):
            hasher.update(data)


def _append(f, hasher, data: bytes) -> None:
    f.write(data)
    hasher.update(data)


def read_manifest_from(path: Path) -> None:
    """Parse a manifest file (not yet renamed into place) and check every file name it gives."""
    try:
        manifest = Manifest.from_json(json.loads(path.read_bytes()))
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"the fetched manifest is not valid JSON ({exc})") from None
    for entry in manifest.units().values():
        safe_name(entry.path)
    if manifest.tokenizer:
        safe_name(manifest.tokenizer)

