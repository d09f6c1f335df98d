"""ops.c's silu_mul (its own exp: the same bits on every ISA) against a float64 reference: within 2 ulp over all of
float32, the ends included (-inf and g far below -104: -0.0; +inf: +inf; NaN: NaN), and each row its own."""

import numpy as np
import pytest
import torch

from nodes.engine.kernels import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="ops.c has no build here (x86 with AVX2 and up, "
                                "aarch64), or no C compiler")
ULPS = 2.0


def exact(g: np.ndarray) -> np.ndarray:
    """silu in float64 (g * e^g where 1 + e^-g overflows)."""
    g = g.astype(np.float64)
    with np.errstate(over="ignore"):
        return np.where(g < -700, g * np.exp(np.maximum(g, -1e4)), g / (1 + np.exp(-g)))


def silu(g: np.ndarray) -> np.ndarray:
    """ops.silu_mul with up = 1 (an exact product): silu alone."""
    gu = torch.from_numpy(np.concatenate([g, np.ones_like(g)])[None].copy())
    return ops.silu_mul(gu).numpy()[0]


def ulps(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|ours - ref| in units of the float32 spacing at ref (the smallest subnormal below the normals)."""
    spacing = np.maximum(np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64), 2.0 ** -149)
    return np.abs(ours.astype(np.float64) - ref) / spacing


@pytest.mark.parametrize("lo, hi", [(-1, 1), (-20, 20), (-130, 130), (-1e-30, 1e-30)])
def test_silu_is_within_2_ulp_of_float64(lo, hi):
    g = np.random.default_rng(7).uniform(lo, hi, 1 << 20).astype(np.float32)
    assert ulps(silu(g), exact(g)).max() <= ULPS


def test_silu_is_within_2_ulp_over_every_bit_pattern():
    g = np.random.default_rng(8).integers(0, 1 << 32, 1 << 21, dtype=np.uint64).astype(np.uint32).view(np.float32)
    g = g[np.isfinite(g)]
    err = ulps(silu(g), exact(g))
    assert err.max() <= ULPS, (g[err.argmax()], err.max())


def test_silu_at_the_ends():
    g = np.array([0.0, -0.0, 88.0, 89.0, 1e38, 3.4e38, np.inf, -88.0, -103.0, -104.5, -108.0, -110.0, -120.5,
                  -1e38, -np.inf, np.nan], dtype=np.float32)
    ours = silu(g)
    assert np.array_equal(ours[:6], g[:6]) and np.signbit(ours[1])  # g itself, -0.0 kept
    assert ours[6] == np.inf
    assert ulps(ours[7:11], exact(g[7:11])).max() <= ULPS  # down into the subnormals
    assert np.all(ours[11:15] == 0) and np.all(np.signbit(ours[11:15]))  # below half the smallest subnormal: -0.0
    assert np.isnan(ours[15])


def test_silu_mul_multiplies_by_up_and_a_row_is_its_own():
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(5, 2 * 1000 + 2 * 7, generator=gen) * 6  # I = 1007: a tail past the vector lanes
    ours = ops.silu_mul(gu)
    gate, up = gu.double().chunk(2, dim=-1)
    exact_mul = torch.from_numpy(exact(gate.float().numpy())) * up
    assert ((ours.double() - exact_mul).abs() <= 3 * 2.0 ** -24 * exact_mul.abs() + 1e-38).all()  # 2 ulp + a rounding
    assert all(torch.equal(ops.silu_mul(gu[i:i + 1]), ours[i:i + 1]) for i in range(5))
    assert torch.equal(ops.silu_mul(gu[2:]), ours[2:])
