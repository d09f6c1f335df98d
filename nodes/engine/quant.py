"""Quantized weight matrices run through torch's CPU kernels: int4 (groups of 32 along K, a scale and a
min each, GGUF Q4_0/Q4_1 blocks kept exactly) and int8 (one scale per row).

The model multiplies by a weight through `linear(x, w)` and embeds through `embed_rows(w, ids)`: a float
tensor, an `Int4` or an `Int8` alike, so the maths (nodes/engine/model.py) knows nothing of quantization.
Every path gives a row the same result whatever other rows share its call (a batch, a verify frame), so greedy
tokens do not depend on speculation or batching: the quantized kernels compute each row alone, float ones go
through fixed-width GEMMs (FEW_ROWS).

int4 with float32 activations goes through our kernel (nodes/engine/kernels/q4.c) wherever it builds, and so do
float32 int8 matrices oneDNN does not take: torch's float32 int4 and int8 paths are scalar loops (docs/performance.md).

Why these kernels (measured on this 2-core AVX-512 box, docs in DESIGN.md 6.1): `_weight_int4pack_mm_for_cpu` and
`_weight_int8pack_mm` read ~18 and ~24 GB/s of packed weights with bfloat16 activations, 10-30x less with float32 or
float16 ones (those paths are not vectorised); which activation dtype a machine runs them in is measured on it
(nodes/engine/dtype_choice.py). Large int8 matrices go through oneDNN's int8 x int8 kernel instead (`Int8`), which
reads 1.1-1.9x more weight bytes a second than `_weight_int8pack_mm`, where its sums are exact (VNNI)."""

from dataclasses import dataclass
from functools import cache

import torch

from nodes.engine.kernels import f32, ops, q4

GROUP = 32  # int4: weights per (scale, min) along K; GGUF's block size
QUANTIZED = ("int4", "int8")
BITS = {"int4": 4 + 32 / GROUP, "int8": 8.0}  # per weight on disk: values, plus int4's float16 (d, m) per group


# Float weights with few rows (decode steps, verify frames, small batches): torch's CPU GEMM for x @ w.T reads w at
# about half the speed of w @ x.T, whose kernel splits the long N side across threads; one row alone takes the GEMV
# path, as slow. Measured on SmolLM2's matrices, 2 threads: one row 0.44 -> 0.25 ms as w @ [x, 0].T. A GEMM's
# low bits for one row depend on how many rows it has (MKL picks its kernel by the shape), so float32 rows go
# through GEMMs of exactly PAIR columns, padded, and bfloat16 / float16 rows through one GEMV each (faster there than
# a pair: 0.61 against 0.83 ms a SmolLM2 layer): a row gives the same bits alone, in a verify frame or in a batch
# (tests/test_batch_invariance.py). Past FEW_ROWS rows (prefill chunks, large batches) one F.linear reads the
# weights once for all; its rows may differ from a lone row's in the low bits (~5e-5 on values ~20). Where f32.c
# builds, float32 rows go through it instead (the same guarantee; SmolLM2's float32 store decoded 13.4 -> 26.2
# tok/s on a 2-core AVX-512 Xeon, bench_decode).
PAIR = 2
FEW_ROWS = 8


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for a float weight [N, K] or a quantized one."""
    if isinstance(w, torch.Tensor):
        if x.dim() == 2 and x.shape[0] <= FEW_ROWS and x.dtype == w.dtype == torch.float32 and f32.available() \
                and x.is_contiguous() and w.is_contiguous():
            y = f32.mm(x, w)
            return y if bias is None else y + bias
        if x.dim() == 2 and x.shape[0] <= FEW_ROWS and x.dtype == w.dtype:
            chunks = x.split(PAIR if w.dtype == torch.float32 else 1)
            y = _few_rows(w, chunks[0]) if len(chunks) == 1 else torch.cat([_few_rows(w, c) for c in chunks])
            return y if bias is None else y + bias
        return torch.nn.functional.linear(x, w, bias)
    y = w.mm(x) if x.dim() == 2 else w.mm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


def kernel_matrix(w) -> ops.Matrix | None:
    """w as ops.c's layer steps take it: the kernel linear(x, w) runs for up to FEW_ROWS float32 rows x and its
    operands; None where that is not one of ours (torch's int4 kernel, oneDNN, float weights in another dtype)."""
    if isinstance(w, torch.Tensor):
        usable = w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous() and f32.available()
        return f32.matrix(w) if usable else None
    if isinstance(w, q4.Q4Rows):
        return w.matrix()
    if isinstance(w, Rows):
        pieces = [kernel_matrix(p) for p in w.pieces]
        return None if None in pieces else ops.rows_matrix(pieces)
    if isinstance(w, Int8) and w.scale.dtype == torch.float32:
        if w.tiled is not None:
            return w.tiled.matrix()
        if not w.onednn and w.shape[1] % GROUP == 0 and q4.available():
            return q4.int8_matrix(w.q, w.scale)
    return None


def _few_rows(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x @ w.T for x [1 or PAIR, K]: float32 as one GEMM of PAIR columns, a half-precision row as one GEMV."""
    if w.dtype != torch.float32:
        return torch.nn.functional.linear(x, w)
    rows = x.shape[0]
    xt = torch.cat([x, x.new_zeros(PAIR - rows, x.shape[1])]) if rows < PAIR else x
    return torch.mm(w, xt.t()).t()[:rows].contiguous()


def as_kernel_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x contiguous in `dtype`; no dispatch when it already is (the usual case: a few per layer per token)."""
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.is_contiguous() else x.contiguous()


def embed_rows(w, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding matrix [V, H], in its compute dtype."""
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.embedding(ids, w)
    return w.rows(ids)


# --- int4: torch's packed CPU layout ------------------------------------------------------------------
# The kernel (aten/src/ATen/native/cpu/int4mm_kernel.cpp) wants [N, K/2] bytes in blocks of BLOCK_N rows
# (64 with AVX-512, 32 otherwise, 16 in aarch64 builds: torch 2.10's), each [K, BLOCK_N/2] bytes: with "lanes"
# (AVX-512, AVX2) byte j holds row j in its low nibble and row j + BLOCK_N/2 in its high one, without (scalar
# and aarch64 builds) rows 2j and 2j+1; a last partial block always pairs. It dequantizes w = (q - 8) * scale +
# zero in float32 (one fma).


@dataclass(frozen=True)
class Layout:
    block: int  # rows per block
    lanes: bool

    @property
    def name(self) -> str:
        return f"{'lanes' if self.lanes else 'pairs'}{self.block}"

    @staticmethod
    def parse(name: str) -> "Layout":
        for layout in LAYOUTS:
            if layout.name == name:
                return layout
        raise ValueError(f"unknown int4 layout {name!r}; known: {[x.name for x in LAYOUTS]}")


LAYOUTS = (Layout(64, True), Layout(32, True), Layout(32, False), Layout(16, False))


def pack_int4(q: torch.Tensor, layout: Layout) -> torch.Tensor:
    """uint8 [N, K/2] in `layout` from values q uint8 [N, K] in [0, 16) (what the kernel's own packer
    makes, without its int32 copy of the input)."""
    n, k = q.shape
    full = n // layout.block * layout.block
    x = q[:full].view(-1, layout.block, k).transpose(1, 2)  # [nb, K, block]
    if layout.lanes:
        half = layout.block // 2
        body = x[..., :half] | (x[..., half:] << 4)
    else:
        body = x[..., 0::2] | (x[..., 1::2] << 4)
    rest = q[full:].t()  # [K, n - full]
    tail = rest[:, 0::2] | (rest[:, 1::2] << 4)
    return torch.cat([body.reshape(-1), tail.reshape(-1)]).view(n, k // 2)


def unpack_int4(packed: torch.Tensor, layout: Layout, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Values uint8 [N, K] (or only `rows` of them) of a packed [N, K/2] tensor."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if rows is None and n % layout.block == 0:  # whole blocks (every model's matrices): a reshape, no gather
        x = packed.reshape(n // layout.block, k, layout.block // 2)
        lo, hi = x & 15, x >> 4
        q = torch.cat([lo, hi], -1) if layout.lanes else torch.stack([lo, hi], -1).flatten(2)
        return q.transpose(1, 2).reshape(n, k)
    flat = packed.reshape(-1)
    full = n // layout.block * layout.block
    if rows is None:
        rows = torch.arange(n)
    block, r = rows // layout.block, rows % layout.block
    out = torch.empty(len(rows), k, dtype=torch.uint8)
    body = rows < full
    if body.any():
        b, rr = block[body], r[body]
        half = layout.block // 2
        if layout.lanes:
            byte, high = rr % half, rr >= half
        else:
            byte, high = rr // 2, rr % 2 == 1
        step = layout.block // 2
        idx = b[:, None] * (k * step) + torch.arange(k)[None, :] * step + byte[:, None]  # [R, K]
        v = flat[idx]
        out[body] = torch.where(high[:, None], v >> 4, v & 15)
    if (~body).any():
        tail = flat[full * k // 2:].view(k, (n - full) // 2)
        rr = rows[~body] - full
        v = tail[:, rr // 2].t()
        out[~body] = torch.where((rr % 2 == 1)[:, None], v >> 4, v & 15)
    return out


@cache
def machine_layout() -> Layout:
    """The layout torch's int4 kernel uses on this machine, found by packing a probe with it."""
    probe = torch.randint(0, 16, (112, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe.int(), 1)
    for layout in LAYOUTS:
        if torch.equal(packed.view(torch.uint8), pack_int4(probe, layout)):
            return layout
    raise RuntimeError("torch's int4 CPU kernel packs weights in a layout this build does not know")


def repack_int4(packed: torch.Tensor, have: Layout, want: Layout) -> torch.Tensor:
    return packed if have == want else pack_int4(unpack_int4(packed, have), want)


def kernel_scales(dm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's (scale, zero) [K/32, N, 2] in `dtype` from the stored (d, m) float16 [K/32, N, 2] of
    w = d q + m: scale = d, zero = m + 8 d. In float32 this is exact (the kernel's fma then rounds
    (q - 8) d + m + 8 d once, like GGUF's d q + m); bfloat16 rounds d and m + 8 d to 8 significant bits."""
    d, m = dm[..., 0].float(), dm[..., 1].float()
    return torch.stack([d, m + 8 * d], dim=-1).to(dtype)


class Int4:
    """Weights [N, K]: w = (q - 8) * scale + zero per group of 32 along K, packed for the int4 kernel."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, layout: Layout):
        self.packed = packed  # uint8 [N, K/2] in `layout`
        self.sz = sz  # [K/32, N, 2] scale and zero in the activation dtype
        self.layout = layout
        self.shape = (packed.shape[0], packed.shape[1] * 2)

    @staticmethod
    def from_dm(packed: torch.Tensor, dm: torch.Tensor, dtype: torch.dtype, layout: Layout) -> "Int4 | q4.Q4Rows":
        if dtype == torch.float32 and q4.available():  # torch's float32 int4 kernel is a scalar loop; ours is not
            if packed.shape[0] % layout.block == 0:
                return q4.Q4Rows.from_torch(packed, dm, layout.block, layout.lanes)
            return q4.Q4Rows.from_values(unpack_int4(packed, layout), dm)
        return Int4(repack_int4(packed, layout, machine_layout()), kernel_scales(dm, dtype), machine_layout())

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] in the activation dtype (the kernel wants it contiguous and of the scales' dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(as_kernel_input(x, self.sz.dtype), self.packed, GROUP,
                                                          self.sz)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` de-quantized as the kernel does (float32 fma, then the activation dtype)."""
        q = unpack_int4(self.packed, self.layout, ids.reshape(-1)).float() - 8  # [R, K]
        sz = self.sz[:, ids.reshape(-1)].float()  # [G, R, 2]
        scale, zero = (sz[..., j].t().repeat_interleave(GROUP, dim=1) for j in (0, 1))
        return torch.addcmul(zero, q, scale).to(self.sz.dtype).view(*ids.shape, self.shape[1])

    def nbytes(self) -> int:
        return self.packed.numel() + self.sz.numel() * self.sz.element_size()


ONEDNN_MIN_WEIGHTS = 1 << 22  # int8 matrices this large go through oneDNN (below: its fixed cost per call loses)


@cache
def onednn_int8_exact() -> bool:
    """Whether oneDNN's u8 x s8 kernel sums exactly on this machine. With VNNI it does; without (AVX2, AVX-512
    before Cascade Lake) it adds pairs of products in int16, which saturate: SmolLM2's int8 output layer erred by
    4-10 % of its largest value under ONEDNN_MAX_CPU_ISA=AVX2, and int4 SmolLM2 (whose embedding is int8) agreed
    with float32 on 2 of 5 prompts. Probed with the largest products, whose pairs saturate int16."""
    k, n = 64, 16
    try:
        packed = torch.ops.onednn.qlinear_prepack(torch.full((n, k), 127, dtype=torch.int8), [1, k])
        y = torch.ops.onednn.qlinear_pointwise(torch.full((1, k), 255, dtype=torch.uint8), 1.0, 128, packed,
                                               torch.ones(n), torch.zeros(n, dtype=torch.int32), None, 1.0, 0,
                                               torch.float32, "none", [], "")
    except (RuntimeError, AttributeError):  # a build without oneDNN's quantized ops
        return False
    return torch.equal(y, torch.full((1, n), 127.0 * 127 * k))


class Int8:
    """Weights [N, K] = q * scale[n], one scale per row.

    Large matrices (>= ONEDNN_MIN_WEIGHTS values) multiply through oneDNN's u8 x s8 VNNI kernel where its sums are
    exact (onednn_int8_exact), like llama.cpp's Q8_0 x Q8_0 dot: activations are quantized too, per row, to two
    int8 terms (the value at a_r / 127 steps, a_r the row's largest magnitude, and its remainder at a finer step),
    so the int32 sums are exact, the activations keep ~14 bits (one term alone, 8 bits a row, lost SmolLM2's
    greedy tokens on 3 of 5 prompts through its output layer) and a row's result does not depend on the other
    rows of a batch. Measured on 8B shapes (tools/bench/bench_int8.py, a shared 2-core box): 1.1-1.3x the
    bfloat16 kernel at 1 row, 1.5-1.9x at 8 rows. Its weight layout is made on first use (~0.5 GB/s, so a
    streamed matrix pays it each time it is read), then q is released unless rows() used it first (a tied
    embedding), so a matrix is held once. Smaller matrices, and every one where oneDNN's sums saturate, use
    `_weight_int8pack_mm` (weights widened to float; ~8 us a call where oneDNN's fixed cost and the activation
    quantization take ~50; under ONEDNN_MAX_CPU_ISA=AVX2 it was also 3x faster than oneDNN's AVX2 path)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.q = q  # int8 [N, K]; None once packed for oneDNN (unless rows need it) or kept in q4.c's tiles
        self.scale = scale.to(dtype)  # [N] in the activation dtype (the int8pack kernel wants them alike)
        self.shape = tuple(q.shape)
        self.onednn = q.numel() >= ONEDNN_MIN_WEIGHTS and onednn_int8_exact()
        self.packed = None  # oneDNN's layout of q, made on first mm
        self.keep_q = False
        ours = not self.onednn and dtype == torch.float32 and self.shape[1] % GROUP == 0 and q4.available()
        self.tiled = q4.Int8Tiles(q, self.scale) if ours and q4.tiles() else None  # AVX2: q4.c's tiles of rows
        if self.tiled is not None:
            self.q = None

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled is not None:
            return self.tiled.mm(x)
        if not self.onednn:
            if self.scale.dtype == torch.float32 and self.shape[1] % GROUP == 0 and q4.available():  # torch's: scalar
                return q4.int8_mm(x, self.q, self.scale)
            return torch.ops.aten._weight_int8pack_mm(as_kernel_input(x, self.scale.dtype), self.q, self.scale)
        if self.packed is None:
            self.packed = torch.ops.onednn.qlinear_prepack(self.q, [1, self.shape[1]])
            self.kernel_scale, self.zeros = self.scale.float(), torch.zeros(self.shape[0], dtype=torch.int32)
            self.ones = torch.ones(self.shape[0])
            if not self.keep_q:
                self.q = None
        # x = a (hi + r) / 127 per row, hi = round(127 x / a), and the remainder r = b lo / 127 the same way: both
        # halves go through the kernel as 2M rows (at a few rows it reads the weights once either way)
        m, xf = x.shape[0], x.float()
        a = xf.abs().amax(-1, keepdim=True).clamp_min_(1e-30)  # [M, 1]
        scaled = xf * (127 / a)  # not in place: xf may be x itself
        hi = scaled.round()
        r = scaled.sub_(hi)  # in [-0.5, 0.5]
        b = r.abs().amax(-1, keepdim=True).clamp_min_(1e-30)
        xq = torch.cat([hi, r.mul_(127 / b).round_()]).add_(128).to(torch.uint8)  # [2M, K] in [1, 255]
        # unit scales: oneDNN returns the exact int32 sums, rounded once to float32, whichever kernel it picks for
        # this many rows (with the scales applied inside, AMX builds' kernels for many rows rounded 1 ulp apart from
        # one row's); the scales then apply here, elementwise, the same for every row
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, self.packed, self.ones, self.zeros, None, 1.0, 0,
                                               torch.float32, "none", [], "").mul_(1 / 127).mul_(self.kernel_scale)
        return y[m:].mul_(b / 127).add_(y[:m]).mul_(a).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tiled is not None:
            return self.tiled.rows(ids)
        if self.q is None:
            raise RuntimeError("rows of an int8 matrix whose values were released once packed for oneDNN")
        self.keep_q = True
        return (self.q[ids].float() * self.scale[ids].float()[..., None]).to(self.scale.dtype)

    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] + self.scale.numel() * self.scale.element_size()


class Rows:
    """Weights [N, K] stacked by rows from pieces of their own formats (formats.Format.pieces: a GGUF layer's Q4_K wq
    and wk as int4 above its Q6_K wv as int8), each piece through its own kernel: a row's result is its piece's."""

    def __init__(self, pieces: list):
        self.pieces = tuple(pieces)
        self.shape = (sum(p.shape[0] for p in self.pieces), self.pieces[0].shape[1])

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.mm(x) for p in self.pieces], dim=-1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` de-quantized (every row is, first: for checks, not an embedding's lookups)."""
        return torch.cat([p.rows(torch.arange(p.shape[0])) for p in self.pieces])[ids]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.pieces)


# --- quantizers: from float weights, and GGUF blocks --------------------------------------------------


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values q uint8 [N, K] and (d, m) float16 [K/32, N, 2] with w ~ d q + m per group of 32 (min/max,
    like GGUF's Q4_1)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs rows of a multiple of {GROUP} values, got {k}")
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = ((g - m.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return q, torch.stack([d, m], dim=-1).transpose(0, 1).contiguous()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and float32 scales [N] (each a bfloat16 value, so the kernel's scales are exact)."""
    amax = w.float().abs().amax(-1)
    scale = (amax / 127).bfloat16().float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = (w.float() * inv[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def gguf_q4(blocks, kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values q uint8 [N, K] and (d, m) float16 [K/32, N, 2] of a Q4_0 or Q4_1 tensor's raw blocks
    (uint8 [N, K/32 * block bytes]), exactly: Q4_1 is d q + m, Q4_0 is d (q - 8), i.e. m = -8 d."""
    raw = torch.from_numpy(blocks.copy()).view(n, k // GROUP, -1)  # [N, G, bytes]
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if kind == "Q4_1":
        m, qs = raw[..., 2:4].contiguous().view(torch.float16)[..., 0], raw[..., 4:]
    else:
        m, qs = -8 * d, raw[..., 2:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)  # a block's low nibbles are its first 16 values
    return q, torch.stack([d, m], dim=-1).transpose(0, 1).contiguous()
