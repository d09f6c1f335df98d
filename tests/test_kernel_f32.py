"""float32 matmuls of few rows through f32.c (nodes/engine/kernels/f32.py): within float32's rounding bound of the
exact product, a row's bits the same alone, in any call of up to FEW_ROWS rows and on any thread count, in every
build this CPU runs (x86 and aarch64 ones); quant.linear takes it for float32 rows where it builds."""

import pytest
import torch

from nodes.engine.kernels import f32
from nodes.engine.kernels.build import BUILDS
from nodes.engine.quant import FEW_ROWS, linear
from tests.test_kernels import run_here, skip_unless_for_this_machine

pytestmark = pytest.mark.skipif(not f32.available(), reason="f32.c has no build here (not x86 with AVX2 nor "
                                "aarch64, or no C compiler): float32 rows keep torch's GEMMs, test_batch_invariance "
                                "covers them")
# [N, K]: SmolLM2's wqkv and w_down, and odd sizes (a K tail shorter than a vector, an N tail short of a tile)
SHAPES = [(960, 576), (576, 1536), (37, 100), (11, 28), (13, 7)]  # K = 28: two tail chunks, one masked


def bounded(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """|y - x w.T| <= (K + 2) u (|x| |w|.T), u = 2^-24: any order of K float32 products and sums, rounded once more
    by the lanes' final sum."""
    exact = x.double() @ w.double().t()
    bound = (x.shape[1] + 2) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    return bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("shape", SHAPES)
def test_within_float32_rounding_and_a_row_is_its_own(shape):
    g = torch.Generator().manual_seed(shape[0])
    w, x = torch.randn(shape, generator=g), torch.randn(FEW_ROWS, shape[1], generator=g)
    alone = torch.cat([f32.mm(r.contiguous(), w) for r in x.split(1)])
    assert bounded(alone, x, w)
    assert all(torch.equal(f32.mm(x[:rows].contiguous(), w), alone[:rows]) for rows in range(2, FEW_ROWS + 1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(f32.mm(x, w), alone)
    finally:
        torch.set_num_threads(threads)


def test_linear_takes_it_for_few_float32_rows_and_adds_the_bias():
    w, x, b = torch.randn(40, 64), torch.randn(3, 64), torch.randn(40)
    assert torch.equal(linear(x, w, b), f32.mm(x, w) + b)
    many = torch.randn(FEW_ROWS + 1, 64)  # past FEW_ROWS: one torch GEMM
    assert torch.allclose(linear(many, w), many @ w.t(), atol=1e-5)


BUILD_CHECK = ("import torch; from nodes.engine.kernels import f32; from nodes.engine.kernels.build import chosen; "
               "from tests.test_kernel_f32 import bounded; "
               "w, x = torch.randn(37, 100), torch.randn(5, 100); "
               "print('none') if chosen('f32') is None else print(chosen('f32')[0], bounded(f32.mm(x, w), x, w), "
               "torch.equal(f32.mm(x, w)[2:3], f32.mm(x[2:3].contiguous(), w)))")


@pytest.mark.slow  # compiles the C kernels
@pytest.mark.parametrize("build", list(BUILDS))
def test_every_build_this_cpu_runs_holds_the_bound(build, tmp_path):
    skip_unless_for_this_machine(build)
    out = run_here(BUILD_CHECK, {"PRIMA_KERNEL_ISA": build, "PRIMA_HOME": str(tmp_path)})
    if out == ["none"]:
        pytest.skip(f"this CPU (or torch's ISA limit) does not run f32.c's {build} build; another build covers it")
    assert out == [build, "True", "True"]
