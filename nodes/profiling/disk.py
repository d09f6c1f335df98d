"""Disk read bandwidth of a store's filesystem: sequential and random reads that bypass the page cache.

The probe reads the store's own weight files when it has enough of them, else a temporary file it
writes (and always removes) in the same directory. Page-cache bypass, best first: O_DIRECT (Linux,
aligned buffers), F_NOCACHE (macOS), posix_fadvise DONTNEED before each pass, else none ("cached",
which over-reports). Reads are single-threaded, as a node loads its layers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from prima_rpc.spec.manifest import MANIFEST, StoreError, read_manifest

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

ALIGN = 4096  # O_DIRECT: offsets, lengths and buffers aligned to the logical block size
SEQ_CHUNK = 1 << 20
RAND_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)  # taken in turn
TEMP_BYTES = 256 << 20
MIN_STORE_BYTES = 64 << 20  # a store with fewer weight bytes is probed with a temp file instead
STREAM_BYTES = 48 << 20  # measure_stream_rate reads this many bytes of whole weight files (at least one)
SEQ_S = 0.5  # the sequential pass stops after this or at the end of the data
RAND_S = 0.6
PROBE_PREFIX = ".prima-disk-probe-"
METHODS = ("O_DIRECT", "F_NOCACHE", "fadvise", "cached")  # best first


@dataclass(frozen=True)
class DiskRates:
    seq_read: float  # B/s, 1 MiB reads in file order
    rand_read: float  # B/s over random aligned reads of RAND_SIZES in turn
    rand_by_size: tuple[tuple[int, float], ...]  # (read size, B/s) per size
    method: str  # "O_DIRECT" | "F_NOCACHE" | "fadvise" | "cached"
    source: str  # "store" (its weight files) | "temp" (a probe file written for this)
    bytes_read: int


def measure_disk(directory: Path, *, temp_bytes: int = TEMP_BYTES, seed: int = 0) -> DiskRates:
    """Read bandwidth of the filesystem holding `directory` (a layer store or any writable directory)."""
    directory = Path(directory)
    files = _store_files(directory)
    if sum(size for _, size in files) >= MIN_STORE_BYTES:
        return _probe(files, "store", seed)
    _remove_stale_probes(directory)
    temp = _write_probe_file(directory, temp_bytes)
    try:
        return _probe([(temp, temp.stat().st_size)], "temp", seed)
    finally:
        temp.unlink(missing_ok=True)


def measure_stream_rate(directory: Path, rate: float, max_bytes: int = STREAM_BYTES, passes: int = 3) -> float:
    """B/s a node's prefetcher gets reading the store's layer files whole, one after another, through its own
    reader (nodes.engine.diskio.ChunkReader, `rate`: the disk it emulates, 0: none) into a buffer: what a read ahead
    delivers, per-read costs included (opening, the first chunk, the last copy, the emulated disk idle between
    reads), where 1 MiB sequential reads measure the disk alone. The best of `passes` passes of about
    max_bytes / passes each (at least one file): a pass that met another process's reads of the same disk
    (one on the shared VM streamed 292 MB/s of an emulated 1000) says nothing of the device. 0.0 when there
    are no files."""
    from nodes.engine.diskio import ChunkReader  # the node's reader: its chunking, reads in flight and emulation

    files = _store_files(directory, prefix="layer.")  # what a prefetcher streams (not the head's units)
    if not files:
        return 0.0
    reader = ChunkReader(rate=rate)
    try:
        staging = torch.empty(max(size for _, size in files), dtype=torch.uint8)

        def sink(offset: int, chunk: torch.Tensor, n: int) -> None:  # as the store's: one core (nodes/engine/store.py)
            ctypes.memmove(staging.data_ptr() + offset, chunk.data_ptr(), n)

        best, i = 0.0, 0
        for _ in range(passes):
            total, start = 0, time.perf_counter()
            while total < max_bytes / passes or not total:
                path, size = files[i % len(files)]
                total += reader.read(path, size, sink)
                i += 1
            best = max(best, total / (time.perf_counter() - start))
        return best
    finally:
        reader.close()


def _store_files(directory: Path, prefix: str = "") -> list[tuple[Path, int]]:
    """The store's weight files (of the units whose names start with `prefix`) and their sizes."""
    if not (directory / MANIFEST).is_file():
        return []
    try:
        manifest, _ = read_manifest(directory)
    except StoreError:
        return []
    out = []
    for unit, entry in manifest.units().items():
        if not unit.startswith(prefix):
            continue
        path = directory / entry.path
        size = path.stat().st_size if path.is_file() else 0
        if size >= ALIGN:
            out.append((path, size))
    return out


def _remove_stale_probes(directory: Path) -> None:
    """Probe files of processes that died mid-probe (the pid is in the name)."""
    for path in directory.glob(PROBE_PREFIX + "*"):
        pid = path.name[len(PROBE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            path.unlink(missing_ok=True)


def _write_probe_file(directory: Path, nbytes: int) -> Path:
    nbytes = min(nbytes, shutil.disk_usage(directory).free // 4) // ALIGN * ALIGN
    if nbytes < SEQ_CHUNK:
        raise OSError(f"too little free disk in {directory} for a disk probe ({nbytes} B usable)")
    fd, name = tempfile.mkstemp(prefix=f"{PROBE_PREFIX}{os.getpid()}-", dir=directory)
    try:
        block = os.urandom(4 << 20)  # incompressible
        left = nbytes
        while left:
            left -= os.write(fd, block[:left])
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean now, so the pages can go
    except BaseException:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    os.close(fd)
    return Path(name)


# ------------------------------------------------------------------ uncached reads


def _open_uncached(path: Path, buf: memoryview) -> tuple[int, str]:
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            pass  # e.g. EINVAL on a filesystem without direct I/O
        else:
            try:
                _pread(fd, buf[:ALIGN], 0)
                return fd, "O_DIRECT"
            except OSError:
                os.close(fd)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    if hasattr(fcntl, "F_NOCACHE"):  # macOS
        try:
            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
            return fd, "F_NOCACHE"
        except OSError:
            pass
    if hasattr(os, "posix_fadvise"):
        return fd, "fadvise"
    return fd, "cached"


def _pread(fd: int, buf: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buf], offset)
    os.lseek(fd, offset, os.SEEK_SET)  # Windows: no preadv
    data = os.read(fd, len(buf))
    buf[:len(data)] = data
    return len(data)


def _drop_cache(fds: list[int], method: str, advice: int | None = None) -> None:
    if method != "fadvise":
        return
    for fd in fds:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if advice is not None:
            os.posix_fadvise(fd, 0, 0, advice)


def _probe(files: list[tuple[Path, int]], source: str, seed: int) -> DiskRates:
    raw = mmap.mmap(-1, SEQ_CHUNK)  # page-aligned, as O_DIRECT needs
    buf = memoryview(raw)
    fds: list[int] = []
    sizes = [size for _, size in files]
    try:
        methods = []
        for path, _ in files:
            fd, method = _open_uncached(path, buf)
            fds.append(fd)
            methods.append(method)
        method = max(methods, key=METHODS.index)  # the weakest bypass among the files
        seq, seq_bytes = _sequential(fds, sizes, method, buf)
        rand, by_size, rand_bytes = _random(fds, sizes, method, buf, random.Random(seed))
    finally:
        for fd in fds:
            os.close(fd)
        buf.release()
        raw.close()
    return DiskRates(seq, rand, by_size, method, source, seq_bytes + rand_bytes)


def _sequential(fds: list[int], sizes: list[int], method: str, buf: memoryview) -> tuple[float, int]:
    _drop_cache(fds, method, getattr(os, "POSIX_FADV_SEQUENTIAL", None))
    total, start = 0, time.perf_counter()
    for fd, size in zip(fds, sizes):
        offset = 0
        while offset < size and time.perf_counter() - start < SEQ_S:
            n = _pread(fd, buf, offset)
            if n <= 0:
                break
            offset += n
            total += n
    return total / (time.perf_counter() - start), total


def _random(fds: list[int], sizes: list[int], method: str, buf: memoryview,
            rng: random.Random) -> tuple[float, tuple[tuple[int, float], ...], int]:
    _drop_cache(fds, method, getattr(os, "POSIX_FADV_RANDOM", None))
    per_size = {s: [0, 0.0] for s in RAND_SIZES}  # size -> [bytes, seconds]
    start, i = time.perf_counter(), 0
    while time.perf_counter() - start < RAND_S or i < len(RAND_SIZES):
        block = RAND_SIZES[i % len(RAND_SIZES)]
        i += 1
        fit = [(fd, size) for fd, size in zip(fds, sizes) if size >= block]
        if not fit:
            continue
        fd, size = rng.choices(fit, weights=[s for _, s in fit])[0]
        offset = rng.randrange((size - block) // ALIGN + 1) * ALIGN
        t = time.perf_counter()
        n = _pread(fd, buf[:block], offset)
        per_size[block][1] += time.perf_counter() - t
        per_size[block][0] += n
    total = sum(b for b, _ in per_size.values())
    seconds = sum(s for _, s in per_size.values())
    by_size = tuple((s, b / t) for s, (b, t) in per_size.items() if t > 0)
    return total / seconds, by_size, total
