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
import weakref

import torch

PAGE = mmap.PAGESIZE
MEMFD = hasattr(os, "memfd_create")  # Linux: elsewhere prefixes are copied
_PROT = getattr(mmap, "PROT_READ", 0) | getattr(mmap, "PROT_WRITE", 0)
_MAP_FIXED = 0x10  # Linux, every architecture
if MEMFD:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_paged: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> the tensors page_rows made


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one position of one (k|v, head) row of a [2, nkv, S, ...] tensor."""
    return t[0, 0, 0].numel() * t.element_size()


def pageable(t: torch.Tensor) -> bool:
    """Whether rows like t's [2, nkv, S, ...] can be mapped page by page: memfd available, a position's bytes
    dividing the page."""
    rb = row_bytes(t)
    return MEMFD and rb > 0 and PAGE % rb == 0


def shareable(t: torch.Tensor) -> bool:
    """Whether a prefix's rows t [2, nkv, L, ...] can be shared: pageable, each row whole pages (a prefix is whole
    blocks of 64 positions: 64 bytes a position do)."""
    return pageable(t) and t.shape[2] * row_bytes(t) % PAGE == 0


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


def page_rows(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor shaped like `like` [2, nkv, S, ...] whose (k|v, head) rows each start on a page (its
    positions rounded up to whole pages a row), so that a prefix's pages can be mapped into it."""
    rb = row_bytes(like)
    cap = pages_positions(rb, like.shape[2])
    anon = mmap.mmap(-1, like.shape[0] * like.shape[1] * cap * rb, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, _PROT)
    t = torch.frombuffer(anon, dtype=like.dtype).view(*like.shape[:2], cap, *like.shape[3:])
    _paged[id(t)] = t
    return t


def map_prefix(prefix: SharedPrefix, t: torch.Tensor, length: int) -> int:
    """Map the whole pages of `prefix`'s positions [0, length) over those of t (from page_rows), copy-on-write;
    returns the bytes mapped (positions past them are the caller's to fill). 0 where t is not from page_rows (its
    memory is torch's allocator's, never remapped)."""
    if _paged.get(id(t)) is not t or prefix.fd < 0:
        return 0
    rb = row_bytes(t)
    rows, row_size = t.shape[0] * t.shape[1], t.shape[2] * rb
    whole = length * rb // PAGE * PAGE  # bytes of each row mapped
    base, src_row = t.data_ptr(), prefix.padded * rb
    for r in range(rows if whole else 0):
        got = _libc.mmap(base + r * row_size, whole, _PROT, mmap.MAP_PRIVATE | _MAP_FIXED, prefix.fd, r * src_row)
        if got != base + r * row_size:
            raise OSError(ctypes.get_errno(), "mapping a cached prefix's pages failed")
    return rows * whole


def mapped_cache(prefix: SharedPrefix, like: torch.Tensor, length: int) -> tuple[torch.Tensor, int]:
    """A request's KV tensor shaped like `like` (page_rows) whose positions [0, length) are those of `prefix`: whole
    pages mapped copy-on-write, the rest copied. Returns it and the bytes it shares."""
    t = page_rows(like)
    shared = map_prefix(prefix, t, length)
    first = shared // (t.shape[0] * t.shape[1] * row_bytes(t)) if shared else 0
    t[:, :, first:length] = prefix.tensor[:, :, first:length]
    return t, shared
