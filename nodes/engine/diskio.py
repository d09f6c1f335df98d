"""Whole-file reads that bypass the page cache: O_DIRECT chunks, several in flight, handed over in order.

Why this mechanism (measured on the 2-core dev box, 45 MB layer files, see tools/bench/bench_offload.py
--read-bench): O_DIRECT with a few chunks in flight reads as fast as buffered reads or mmap and costs the
reader 2-6 ms of CPU per layer instead of 12-30 ms, so a prefetch running beside the compute thread
slows the compute least. It also leaves nothing in the page cache, so a node's footprint is its RSS.
Where O_DIRECT is missing or refused (macOS, tmpfs) reads are buffered (F_NOCACHE on macOS) and the
file's cached pages are dropped after each read (POSIX_FADV_DONTNEED) so that the next read is real too.

$PRIMA_DISK_MBPS emulates a slower disk (benchmarks only): reads are real, but each chunk is handed over
no earlier than that rate allows. Nodes on one machine share its disk, devices of a home have one each.
"""

import errno
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from prima_rpc.spec.manifest import StoreError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

ALIGN = 4096  # O_DIRECT: buffer address, file offset and length multiples of the logical block size
CHUNK = 4 << 20
IN_FLIGHT = 4
DISK_MBPS_ENV = "PRIMA_DISK_MBPS"

# sink(file_offset, chunk [n] uint8 tensor over the staging buffer, n): consumes one chunk, in file order
Sink = Callable[[int, torch.Tensor, int], None]


class ChunkReader:
    """Reads files through `in_flight` page-aligned staging buffers of `chunk` bytes (the only memory it holds)."""

    def __init__(self, chunk: int = CHUNK, in_flight: int = IN_FLIGHT, direct: bool = True, rate: float | None = None):
        """rate: bytes per second to emulate (None: $PRIMA_DISK_MBPS, 0: as fast as the disk goes)."""
        assert chunk % ALIGN == 0 and in_flight >= 1, (chunk, in_flight)
        self.chunk, self.in_flight = chunk, in_flight
        self.rate = emulated_rate() if rate is None else rate
        self._clock = 0.0  # emulated disk: when it finishes the bytes handed over so far
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._maps = [mmap.mmap(-1, chunk) for _ in range(in_flight)]  # anonymous maps are page-aligned
        self._views = [memoryview(m) for m in self._maps]
        self._tensors = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="disk")
        self._lock = threading.Lock()  # one file at a time: the staging buffers are shared

    @property
    def staging_bytes(self) -> int:
        return self.chunk * self.in_flight

    @property
    def method(self) -> str:
        method = "O_DIRECT" if self.direct else "buffered+DONTNEED"
        return f"{method}, emulated {self.rate / 1e6:g} MB/s" if self.rate else method

    def read(self, path: Path, size: int, sink: Sink, ranges: list[tuple[int, int]] | None = None) -> int:
        """Feed the `size` bytes of `path` (or only byte `ranges` of it, [start, stop), in the order given) to
        `sink` chunk by chunk; returns the bytes read (ranges widen to whole blocks)."""
        spans = _blocks(ranges, size) if ranges is not None else [(0, size)]
        with self._lock:
            if self.direct:
                try:
                    return self._read(path, size, sink, spans, direct=True)
                except _DirectRefused:
                    self.direct = False  # this filesystem: buffered from now on
            return self._read(path, size, sink, spans, direct=False)

    def _read(self, path: Path, size: int, sink: Sink, spans: list[tuple[int, int]], direct: bool) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                raise _DirectRefused from None
            raise StoreError(f"cannot read {path}: {exc.strerror}") from None
        if not direct and fcntl is not None and hasattr(fcntl, "F_NOCACHE"):
            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)  # macOS: no O_DIRECT, but reads can skip the cache
        pending: deque[Future] = deque()
        offsets = [(o, stop) for start, stop in spans for o in range(start, stop, self.chunk)]
        self._clock = max(self._clock, time.monotonic())  # an idle emulated disk starts now, with no credit
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise StoreError(f"{path}: {actual} bytes, manifest says {size} (truncated or replaced)")
            for i in range(min(self.in_flight, len(offsets))):
                pending.append(self._submit(fd, i, *offsets[i]))
            total = 0
            for i, (offset, stop) in enumerate(offsets):
                try:
                    n = pending.popleft().result()
                except OSError as exc:
                    if direct and i == 0 and exc.errno == errno.EINVAL:
                        raise _DirectRefused from None
                    raise StoreError(f"cannot read {path}: {exc.strerror}") from None
                if n != min(self.chunk, stop - offset):
                    raise StoreError(f"{path}: short read at byte {offset + n} of {size} (truncated?)")
                self._pace(n)
                sink(offset, self._tensors[i % self.in_flight][:n], n)
                total += n
                if i + self.in_flight < len(offsets):
                    pending.append(self._submit(fd, i + self.in_flight, *offsets[i + self.in_flight]))
            return total
        finally:
            for f in pending:  # a failed read: wait for the others before the fd and buffers go
                f.exception()
            # Buffered reads cached the file; O_DIRECT did not, but pages cached earlier (the store's writer,
            # another reader) would stay: drop them either way, the node's copy is the only one it needs.
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    def _pace(self, n: int) -> None:
        """Emulated disk: wait until it would have delivered these n bytes too."""
        if self.rate:
            self._clock += n / self.rate
            if (delay := self._clock - time.monotonic()) > 0:
                time.sleep(delay)

    def _submit(self, fd: int, i: int, offset: int, stop: int) -> Future:
        # O_DIRECT lengths are rounded up to ALIGN; the read stops at the end of the file.
        length = min(self.chunk, -(-(stop - offset) // ALIGN) * ALIGN)
        return self._pool.submit(_pread_full, fd, self._views[i % self.in_flight][:length], offset)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _blocks(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Byte ranges widened to whole ALIGN blocks (O_DIRECT offsets), clipped to the file, in the order given
    (the caller's order of need), merged with the one before where they touch."""
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        if not 0 <= start <= stop <= size:
            raise ValueError(f"range [{start}, {stop}) is outside a file of {size} bytes")
        start, stop = start // ALIGN * ALIGN, min(-(-stop // ALIGN) * ALIGN, size)
        if out and out[-1][0] <= start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        elif stop > start:
            out.append((start, stop))
    return out


def emulated_rate() -> float:
    """Bytes per second from $PRIMA_DISK_MBPS (MB = 10**6 bytes); 0 when unset."""
    text = os.environ.get(DISK_MBPS_ENV, "")
    try:
        mbps = float(text) if text else 0.0
    except ValueError:
        raise StoreError(f"{DISK_MBPS_ENV}={text!r} is not a number") from None
    if not mbps >= 0 or mbps == float("inf"):
        raise StoreError(f"{DISK_MBPS_ENV} must be a positive number of MB/s, got {text!r}")
    return mbps * 1e6


class _DirectRefused(Exception):
    """The filesystem does not do O_DIRECT."""


def _pread_full(fd: int, buf: memoryview, offset: int) -> int:
    got = 0
    while got < len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf[got:]], offset + got)
        else:  # platforms without preadv: one more copy
            data = os.pread(fd, len(buf) - got, offset + got)
            n = len(data)
            buf[got:got + n] = data
        got += n
        if n == 0 or n % ALIGN:  # the end of the file (O_DIRECT cannot go on from an unaligned offset)
            break
    return got
