"""Our int4 kernel (nodes/engine/kernels/q4.c through q4.py): the weights it multiplies by are the stored ones bit for
bit (GGUF Q4_0 / Q4_1), its result is within each activation mode's stated bound of the exact product (q8: the
product with ggml's Q8_0 activations, to float32 rounding), a row's bits do not depend on what shares its call, every
build this CPU runs (AVX2, AVX-512BW, AVX-512 VNNI; NEON with and without dotprod) holds the same, AVX2 and NEON
builds give the same bits, and it is built for the instruction set torch may use (or torch's kernels stay). Its int8
path (float32 int8 matrices outside oneDNN) holds the same bounds."""

import ctypes
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch

from nodes.engine.kernels import q4
from nodes.engine.kernels.build import BUILDS
from nodes.engine.quant import (
    LAYOUTS,
    Int4,
    Int8,
    gguf_q4,
    linear,
    machine_layout,
    pack_int4,
    quantize_int4,
    quantize_int8,
)

pytestmark = pytest.mark.skipif(not q4.available(), reason="q4.c has no build here (not x86 with AVX2 nor aarch64, "
                                "or no C compiler): int4 keeps torch's kernels, which tests/test_quant.py covers")
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def dequantized(q: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """d q + m float32 [N, K], rounded once, as GGUF de-quantizes."""
    d, m = (dm[..., j].float().t().repeat_interleave(32, dim=1) for j in (0, 1))
    return d * q.float() + m


@pytest.fixture(params=list(q4.MODES))
def mode(request, monkeypatch):
    """Each activation mode in turn (read when a weight is made)."""
    monkeypatch.setenv(q4.MODE_ENV, request.param)
    return request.param


@pytest.fixture
def exact(monkeypatch):
    monkeypatch.setenv(q4.MODE_ENV, "exact")


def weight(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, q4.Q4Rows]:
    q, dm = quantize_int4(torch.randn(*shape) * 0.05)
    return q, dm, Int4.from_dm(pack_int4(q, machine_layout()), dm, torch.float32, machine_layout())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [128, 112])  # whole blocks of every layout; a last partial block of 64-row ones
def test_the_kernel_multiplies_by_the_gguf_weights_bit_for_bit(kind, layout, rows, exact):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    x = np.random.default_rng(rows).standard_normal((rows, 96)).astype(np.float32)
    blocks = quantize(x, GGMLQuantizationType[kind])
    q, dm = gguf_q4(blocks, kind, rows, 96)
    w = Int4.from_dm(pack_int4(q, layout), dm, torch.float32, layout)
    assert isinstance(w, q4.Q4Rows)
    gguf = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind]))
    assert torch.equal(w.rows(torch.arange(rows)), gguf)
    assert torch.equal(w.mm(torch.eye(96)).t(), gguf)  # an exact activation: the weights come back as stored


def rounding(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 rounding of the sums [M, N]: K * 2^-24 of sum |x| |w|, with room."""
    return x.shape[1] * 2.0 ** -24 * (x.abs() @ w.abs().t())


def activation_bound(x: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    """q4.c's stated bound [M, N]: each activation off by at most BOUND[mode] of its group's largest |x| (q8: plus
    the absolute part where its float16 scale is subnormal), plus float32 rounding of the sums."""
    groups = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)  # [M, K]
    tiny = q4.TINY_SCALE if mode == "q8" else 0.0
    return (groups * q4.BOUND[mode] + tiny) @ w.abs().t() + rounding(x, w)


@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (64, 4096), (36, 96)])  # an odd count of groups too
def test_the_result_is_within_the_stated_bound_and_near_float32(shape, mode):
    torch.manual_seed(sum(shape))
    q, dm, w = weight(shape)
    x = torch.randn(9, shape[1]) * torch.logspace(-6, 2, shape[1])  # groups of very different magnitudes
    exact = x.double() @ dequantized(q, dm).double().t()
    err = (w.mm(x).double() - exact).abs()
    assert (err <= activation_bound(x.double(), dequantized(q, dm).double(), mode)).all()
    # measured: exact 1-3e-4 (10-30x closer than bfloat16 activations, ~3.5e-3), q8 4-9e-3 (llama.cpp's numerics)
    assert err.max() / exact.abs().max() < {"exact": 6e-4, "q8": 0.02}[mode]


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """x as ggml's quantize_row_q8_0 (its AVX path) leaves it: d q, d = max |x| / 127 in float16, q = x 127 / max |x|
    rounded to nearest even."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    d = (amax / 127).half().float()
    id = torch.full_like(amax, 127.0) / amax  # a true division: torch's `127 / amax` is 127 * (1 / amax), rounded twice
    q = torch.where(amax > 0, g * id, torch.zeros_like(g)).round()
    return (d * q).view_as(x)


@pytest.mark.parametrize("shape", [(576, 1536), (37, 96)])  # a weight row count that is not a whole tile too
def test_q8_is_the_product_with_ggml_q8_0_activations(shape, monkeypatch):
    monkeypatch.setenv(q4.MODE_ENV, "q8")
    q, dm = quantize_int4(torch.randn(*shape) * 0.05)
    w = q4.Q4Rows.from_values(q, dm)
    x = torch.randn(6, shape[1]) * 3
    xq = q8_0(x).double()
    err = (w.mm(x).double() - xq @ dequantized(q, dm).double().t()).abs()
    assert (err <= rounding(xq, dequantized(q, dm).double())).all()


@pytest.mark.parametrize("shape", [(576, 1536), (1728, 576), (37, 96)])
def test_a_row_has_the_same_bits_in_any_call(shape, mode):
    q, dm = quantize_int4(torch.randn(*shape) * 0.05)
    w = q4.Q4Rows.from_values(q, dm)
    x = torch.randn(40, shape[1])
    alone = torch.cat([linear(row, w) for row in x.split(1)])
    for rows in range(2, 41):
        assert torch.equal(linear(x[:rows], w), alone[:rows]), rows
    assert torch.equal(linear(x.view(4, 10, -1), w), alone.view(4, 10, -1))  # a [B, T, K] input too


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prompt_row_has_the_bits_of_a_one_row_call(threads, mode):
    """Prompt-sized calls (AVX2: q4_gemm_avx2.h's blocks of 64 rows in steps of 4, the last rows by the tiled
    kernel) give each row the bits of a call of its own, however the threads split it."""
    torch.manual_seed(threads)
    q, dm = quantize_int4(torch.randn(100, 576) * 0.05)  # 12.5 tiles of 8 rows: a partial last one
    w, x = q4.Q4Rows.from_values(q, dm), torch.randn(135, 576)  # 2 blocks of 64, a step of 4 and 3 rows
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        many, alone = w.mm(x), torch.cat([w.mm(r) for r in x.split(1)])
    finally:
        torch.set_num_threads(was)
    assert torch.equal(many, alone)


def run_here(code: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()[-1].split()  # the last line: a failed build is logged before it


CHECK = ("import torch; from nodes.engine.kernels import q4; from nodes.engine.quant import *; "
         "q, dm = quantize_int4(torch.randn(64, 64)); p = pack_int4(q, machine_layout()); "
         "w = Int4.from_dm(p, dm, torch.float32, machine_layout()); "
         "print(torch.backends.cpu.get_cpu_capability(), type(w).__name__, "
         "torch.equal(w.mm(torch.eye(64)).t(), w.rows(torch.arange(64))), q4.build())")
EXACT = {q4.MODE_ENV: "exact"}
MACHINE = platform.machine().lower()
X86 = pytest.mark.skipif(MACHINE not in BUILDS["avx2"][2], reason=f"x86's ISA limits: this is {MACHINE}")
ARM = pytest.mark.skipif(MACHINE not in BUILDS["neon"][2], reason=f"aarch64's NEON builds: this is {MACHINE}")


def skip_unless_for_this_machine(build: str) -> None:
    if MACHINE not in BUILDS[build][2]:
        pytest.skip(f"the {build} build is for {' / '.join(BUILDS[build][2])}, this is {MACHINE}")


@pytest.mark.slow  # compiles the C kernels
@X86
def test_limited_to_avx2_the_kernel_is_built_for_it_and_exact(tmp_path):
    out = run_here(CHECK, {**AVX2, **EXACT, "PRIMA_HOME": str(tmp_path)})
    assert out == ["AVX2", "Q4Rows", "True", "avx2", "exact"]


def build_check() -> None:
    """This process's build (PRIMA_KERNEL_ISA) in both modes: a row's bits are its own in any call, exact gives the
    weights back, q8 is the product with ggml's Q8_0 activations (run by the test below in a process of its own)."""
    if q4.build() is None:
        return print("none")
    q, dm = quantize_int4(torch.randn(36, 160) * 0.05)  # 5 groups a row: pairs and a last odd group
    w, x = q4.Q4Rows.from_values(q, dm), torch.randn(9, 160)
    ok = []
    for value in q4.MODES.values():
        w.mode = value
        alone = torch.cat([w.mm(r) for r in x.split(1)])
        ok.append(all(torch.equal(w.mm(x[:rows]), alone[:rows]) for rows in range(2, 10)))
    w.mode = q4.MODES["exact"]
    ok.append(torch.equal(w.mm(torch.eye(160)).t(), w.rows(torch.arange(36))))
    w.mode, xq = q4.MODES["q8"], q8_0(x).double()
    ok.append(bool(((w.mm(x) - xq @ dequantized(q, dm).double().t()).abs()
                    <= rounding(xq, dequantized(q, dm).double())).all()))
    print(q4.build().split()[0], *ok)


@pytest.mark.slow  # compiles the C kernels
@pytest.mark.parametrize("build", list(BUILDS))
def test_every_build_this_cpu_runs_is_exact_and_row_invariant(build, tmp_path):
    skip_unless_for_this_machine(build)
    out = run_here("from tests.test_kernels import build_check; build_check()",
                   {"PRIMA_KERNEL_ISA": build, "PRIMA_HOME": str(tmp_path)})
    if out == ["none"]:
        pytest.skip(f"this CPU (or torch's ISA limit) does not run q4.c's {build} build; another build covers it")
    assert out == [build, "True", "True", "True", "True"]


@pytest.mark.slow  # a process that imports torch
def test_an_unknown_kernel_isa_is_a_clear_error(tmp_path):
    env = {**os.environ, "PRIMA_KERNEL_ISA": "sse9", "PRIMA_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "PRIMA_KERNEL_ISA='sse9' is not a kernel build" in out.stderr


@pytest.mark.slow  # compiles the C kernels
@X86
def test_without_a_build_for_the_isa_torch_kernels_stay(tmp_path):
    """ATEN_CPU_CAPABILITY=default (no vector instructions for torch): q4.c is not used, int4 is torch's Int4."""
    assert run_here(CHECK, {"ATEN_CPU_CAPABILITY": "default", "PRIMA_HOME": str(tmp_path)})[1] == "Int4"


@ARM
def test_on_aarch64_torchs_default_capability_keeps_neon(tmp_path):
    """torch's DEFAULT kernels on aarch64 are NEON ones (NEON is part of every aarch64 CPU): q4.c runs there too."""
    out = run_here(CHECK, {"ATEN_CPU_CAPABILITY": "default", **EXACT, "PRIMA_HOME": str(tmp_path)})
    assert out[1:4] == ["Q4Rows", "True", "neon-dotprod" if neon_dotprod() else "neon"]


def neon_dotprod() -> bool:
    """Whether this aarch64 CPU has the dot product instructions, asked as cpu_ok.h asks (Linux's AT_HWCAP)."""
    libc = ctypes.CDLL(None)
    libc.getauxval.restype = ctypes.c_ulong
    return bool(libc.getauxval(16) & (1 << 20))  # AT_HWCAP, HWCAP_ASIMDDP


def test_a_build_for_another_machine_is_never_chosen(tmp_path):
    """PRIMA_KERNEL_ISA naming the other machine's build (neon on x86, avx2 on aarch64): no build, torch's kernels."""
    other = "avx2" if MACHINE in BUILDS["neon"][2] else "neon"
    assert run_here(CHECK, {"PRIMA_KERNEL_ISA": other, "PRIMA_HOME": str(tmp_path)})[1] == "Int4"


def test_without_a_compiler_torch_kernels_stay(tmp_path):
    out = run_here(CHECK, {"CC": str(tmp_path / "no-such-compiler"), "PRIMA_HOME": str(tmp_path)})
    assert out[1] == "Int4"


def int8_weight(shape: tuple[int, int]) -> tuple[torch.Tensor, Int8]:
    """A float32 int8 matrix on q4.c's int8 path (below oneDNN's size, or where its sums are not exact) and its
    de-quantized values (float64)."""
    q, scale = quantize_int8(torch.randn(*shape) * 0.05)
    w = Int8(q, scale, torch.float32)
    w.onednn = False
    return q.double() * scale.double()[:, None], w


@pytest.mark.parametrize("shape", [(576, 1536), (37, 96)])
def test_int8_weights_come_back_bit_for_bit(shape, exact):
    deq, w = int8_weight(shape)
    assert torch.equal(w.mm(torch.eye(shape[1])).t(), deq.float())


@pytest.mark.parametrize("shape", [(576, 1536), (37, 96)])
def test_int8_is_within_the_stated_bound_and_a_row_is_its_own(shape, mode):
    torch.manual_seed(sum(shape))
    deq, w = int8_weight(shape)
    x = torch.randn(9, shape[1]) * torch.logspace(-6, 2, shape[1])
    err = (w.mm(x).double() - x.double() @ deq.t()).abs()
    assert (err <= activation_bound(x.double(), deq, mode)).all()
    alone = torch.cat([w.mm(r) for r in x.split(1)])
    assert all(torch.equal(w.mm(x[:rows]), alone[:rows]) for rows in range(2, 10))


@pytest.mark.skipif(not q4.tiles(), reason="int8 tiles are AVX2 builds' layout; other builds keep int8 rows")
def test_tiled_int8_rows_are_their_values_times_the_row_scale():
    """An embedding's lookups out of q4.c's int8 tiles: value times scale in float32, as from the untiled rows, for
    any shape of ids and a last tile only partly filled; an id outside the rows fails and writes nothing."""
    gen = torch.Generator().manual_seed(3)
    w8 = torch.randint(-127, 128, (37, 96), dtype=torch.int8, generator=gen)
    s8 = torch.rand(37, generator=gen) / 64
    tiled = q4.Int8Tiles(w8, s8)
    ids = torch.tensor([[36, 0, 9], [8, 8, 35]])
    assert torch.equal(tiled.rows(ids), w8[ids].float() * s8[ids][..., None])
    assert tiled.rows(torch.tensor([], dtype=torch.int64)).shape == (0, 96)
    for bad in (-1, 37):
        with pytest.raises(IndexError, match=r"\[0, 37\)"):
            tiled.rows(torch.tensor([0, bad]))


def same_bits_outputs() -> bytes:
    """The outputs of q4.c (int4 and int8, in this process's mode), f32.c and ops.c's RMSNorm for inputs made of
    integers and powers of two (numpy's streams: the same on every machine), as bytes."""
    from nodes.engine.kernels import f32, ops

    rng = np.random.default_rng(7)
    q = torch.from_numpy(rng.integers(0, 16, (37, 160), dtype=np.uint8))
    dm = torch.from_numpy((rng.integers(-1000, 1000, (5, 37, 2)) / 65536).astype(np.float16))  # exact in float16
    x = torch.from_numpy(np.ldexp(rng.integers(-2**20, 2**20, (9, 160)), rng.integers(-40, -10, (9, 160)))).float()
    w8 = torch.from_numpy(rng.integers(-127, 128, (37, 160), dtype=np.int8))
    s8 = torch.from_numpy(np.ldexp(rng.integers(1, 2**20, 37), -30)).float()
    int8 = q4.Int8Tiles(w8, s8).mm(x) if q4.tiles() else q4.int8_mm(x, w8, s8)  # as quant.Int8 takes them
    out = [q4.Q4Rows.from_values(q, dm).mm(x), int8, f32.mm(x, x.flip(0).contiguous()), ops.rms_norm(x, x[0], 1e-5)]
    return b"".join(t.contiguous().numpy().tobytes() for t in out)


# sha256 of same_bits_outputs() in each mode from the avx2 build: NEON builds sum each output as its tiles do
SAME_BITS = {"exact": "33b74e0b82326932049c4e6f39ae952ca16f733088cc41017f4fbc4b6941c0e7",
             "q8": "a147bbb1c65303e90efe4495f37f5f43c30aec5124a8ad6a943bf93d09b69fed"}


@pytest.mark.slow  # compiles the C kernels
@pytest.mark.parametrize("build", ["avx2", "neon-dotprod", "neon"])  # AVX-512 builds sum in other orders
def test_avx2_and_neon_builds_give_the_same_bits(build, mode, tmp_path):
    skip_unless_for_this_machine(build)
    out = run_here("import hashlib; from nodes.engine.kernels import q4; from tests.test_kernels import "
                   "same_bits_outputs; b = q4.build(); "
                   "print(b, hashlib.sha256(same_bits_outputs()).hexdigest() if b else '')",
                   {"PRIMA_KERNEL_ISA": build, "PRIMA_HOME": str(tmp_path)})  # the mode fixture's variable too
    if out == ["None"]:
        pytest.skip(f"this CPU (or torch's ISA limit) does not run the {build} build")
    assert out == [build, mode, SAME_BITS[mode]]
