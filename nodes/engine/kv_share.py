"""Copy-on-write prefix KV: a cached prefix's rows live in shared memory (a memfd), and a request that starts from it
maps those pages into its own KV tensor instead of copying them. Every request on one system prompt then holds the
prefix's pages once; a page a request writes to (a sliding-window ring wrapping onto it) becomes its own copy, by
the kernel's copy-on-write, so nothing it does reaches the prefix or another request.

The request's tensor keeps the layout every attention path reads ([2, nkv, S, row] contiguous, one pointer), so the
C kernels and SDPA see the same bytes as after a copy: the same bits, alone or in a batch. It needs each (k|v, head)
row of the request to start on a page: the request's positions are rounded up to a whole number of pages a row
(at most a page a row more), and a position's bytes must divide the page. Where that or memfd (Linux) is missing,
`share` falls back to a copy.
"""

import ctypes
import mmap
import os

import torch

PAGE = mmap.PAGESIZE
_PROT = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # Linux, every architecture
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one position of one (k|v, head) row of a [2, nkv, S, ...] tensor."""
    return t[0, 0, 0].numel() * t.element_size()


def shareable(t: torch.Tensor) -> bool:
    """Whether a prefix's rows t [2, nkv, L, ...] can be mapped page by page: memfd available, a position's bytes
    dividing the page and each row whole pages (a prefix is whole blocks of 64 positions: 64 bytes a position do)."""
    rb = row_bytes(t)
    return hasattr(os, "memfd_create") and rb > 0 and PAGE % rb == 0 and t.shape[2] * rb % PAGE == 0


def pages_positions(rb: int, positions: int) -> int:
    """positions rounded up to whole pages of rb-byte positions."""
    per = PAGE // rb
    return -(-positions // per) * per


class SharedPrefix:
    """One layer's prefix rows [2, nkv, L, ...] in a memfd, each row padded to whole pages (`tensor` views them)."""

    def __init__(self, rows: torch.Tensor):
        self.length, rb = rows.shape[2], row_bytes(rows)
        self.padded = pages_positions(rb, self.length)
        shape = (*rows.shape[:2], self.padded, *rows.shape[3:])
        size = rows.shape[0] * rows.shape[1] * self.padded * rb
        self.fd = os.memfd_create("prima-prefix", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, _PROT)
        self.full = torch.frombuffer(self._map, dtype=rows.dtype).view(shape)
        self.full[:, :, :self.length] = rows
        self.tensor = self.full[:, :, :self.length]  # what PrefixCache hands out (read only by convention)

    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def close(self) -> None:
        """Drop the cache's hold (requests that mapped its pages keep them until they end)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def mapped_cache(prefix: SharedPrefix, like: torch.Tensor, length: int) -> tuple[torch.Tensor, int]:
    """A request's KV tensor shaped like `like` (its positions rounded up to whole pages a row) whose positions
    [0, length) are those of `prefix`: whole pages mapped copy-on-write, the rest copied. Returns it and the bytes
    it shares."""
    rb = row_bytes(like)
    cap = pages_positions(rb, like.shape[2])
    rows, row_size = like.shape[0] * like.shape[1], cap * rb
    anon = mmap.mmap(-1, rows * row_size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, _PROT)
    t = torch.frombuffer(anon, dtype=like.dtype).view(*like.shape[:2], cap, *like.shape[3:])
    whole = length * rb // PAGE * PAGE  # bytes of each row mapped; positions past them are copied
    base, src_row = t.data_ptr(), prefix.padded * rb
    for r in range(rows if whole else 0):
        got = _libc.mmap(base + r * row_size, whole, _PROT, mmap.MAP_PRIVATE | _MAP_FIXED, prefix.fd, r * src_row)
        if got != base + r * row_size:
            raise OSError(ctypes.get_errno(), "mapping a cached prefix's pages failed")
    first = whole // rb
    t[:, :, first:length] = prefix.tensor[:, :, first:length]
    return t, rows * whole
