"""Our int4 kernel (nodes/engine/kernels/q4.c through q4.py): the weights it multiplies by are the stored ones bit for
bit (GGUF Q4_0 / Q4_1), its result is within its stated bound of the exact product, a row's bits do not depend on
what shares its call, and it is built for the instruction set torch may use (or torch's kernels stay)."""

import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch

from nodes.engine.kernels import q4
from nodes.engine.quant import LAYOUTS, Int4, gguf_q4, linear, machine_layout, pack_int4, quantize_int4

pytestmark = pytest.mark.skipif(not q4.available(), reason="q4.c has no build here (not x86 with AVX2, or no C "
                                "compiler): int4 keeps torch's kernels, which tests/test_quant.py covers")
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def dequantized(q: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """d q + m float32 [N, K], rounded once, as GGUF de-quantizes."""
    d, m = (dm[..., j].float().t().repeat_interleave(32, dim=1) for j in (0, 1))
    return d * q.float() + m


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [128, 112])  # whole blocks of every layout; a last partial block of 64-row ones
def test_the_kernel_multiplies_by_the_gguf_weights_bit_for_bit(kind, layout, rows):
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


def activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q4.c's stated bound [M, N]: each activation off by at most its group's largest |x| / 16256, plus float32
    rounding of the sums (K * 2^-24 of sum |x| |w|, with room)."""
    groups = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)  # [M, K]
    return (groups / 16256) @ w.abs().t() + x.shape[1] * 2.0 ** -24 * (x.abs() @ w.abs().t())


@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (64, 4096)])
def test_the_result_is_within_the_stated_bound_and_near_float32(shape):
    w = torch.randn(*shape) * 0.05
    q, dm = quantize_int4(w)
    weight = Int4.from_dm(pack_int4(q, machine_layout()), dm, torch.float32, machine_layout())
    x = torch.randn(9, shape[1]) * torch.logspace(-3, 2, shape[1])  # groups of very different magnitudes
    exact = x.double() @ dequantized(q, dm).double().t()
    err = (weight.mm(x).double() - exact).abs()
    assert (err <= activation_bound(x.double(), dequantized(q, dm).double())).all()
    assert err.max() / exact.abs().max() < 3e-4  # ~1e-4 measured: 30x closer than bfloat16 activations (~3.5e-3)


@pytest.mark.parametrize("shape", [(576, 1536), (1728, 576)])
def test_a_row_has_the_same_bits_in_any_call(shape):
    q, dm = quantize_int4(torch.randn(*shape) * 0.05)
    w = Int4.from_dm(pack_int4(q, machine_layout()), dm, torch.float32, machine_layout())
    x = torch.randn(40, shape[1])
    alone = torch.cat([linear(row, w) for row in x.split(1)])
    for rows in range(2, 41):
        assert torch.equal(linear(x[:rows], w), alone[:rows]), rows
    assert torch.equal(linear(x.view(4, 10, -1), w), alone.view(4, 10, -1))  # a [B, T, K] input too


def run_here(code: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()[-1].split()  # the last line: a failed build is logged before it


CHECK = ("import torch; from nodes.engine.kernels import q4; from nodes.engine.quant import *; "
         "q, dm = quantize_int4(torch.randn(64, 64)); p = pack_int4(q, machine_layout()); "
         "w = Int4.from_dm(p, dm, torch.float32, machine_layout()); "
         "print(torch.backends.cpu.get_cpu_capability(), type(w).__name__, "
         "torch.equal(w.mm(torch.eye(64)).t(), w.rows(torch.arange(64))))")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="ATEN_CPU_CAPABILITY=avx2 is x86's")
def test_limited_to_avx2_the_kernel_is_built_for_it_and_exact(tmp_path):
    assert run_here(CHECK, {**AVX2, "PRIMA_HOME": str(tmp_path)}) == ["AVX2", "Q4Rows", "True"]


def test_without_a_build_for_the_isa_torch_kernels_stay(tmp_path):
    """ATEN_CPU_CAPABILITY=default (no vector instructions for torch): q4.c is not used, int4 is torch's Int4."""
    assert run_here(CHECK, {"ATEN_CPU_CAPABILITY": "default", "PRIMA_HOME": str(tmp_path)})[1] == "Int4"


def test_without_a_compiler_torch_kernels_stay(tmp_path):
    out = run_here(CHECK, {"CC": str(tmp_path / "no-such-compiler"), "PRIMA_HOME": str(tmp_path)})
    assert out[1] == "Int4"
