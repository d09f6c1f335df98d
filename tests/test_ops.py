"""ops.c's float32 layer steps (nodes/engine/kernels/ops.py) against the torch ops they replace: RMSNorm within a few
float32 roundings, a segment's RoPE + KV write + row attention with the cache's keys and values equal bit for bit and
the attention within float32 summation's rounding, and each row's result the same alone or in a frame."""

import pytest
import torch

from nodes.engine import model
from nodes.engine.kernels import ops
from nodes.engine.rope import Rope
from nodes.engine.row_attention import attend_rows
from prima_rpc.spec.manifest import ModelConfig

pytestmark = pytest.mark.skipif(not ops.available(), reason="ops.c has no build here (x86 with AVX2 and "
                                "up, aarch64), or no C compiler")


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32


@pytest.mark.parametrize("rows, hidden", [(1, 576), (5, 4096), (3, 100)])
def test_rms_norm_is_torchs_to_rounding_and_a_row_is_its_own(rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
    ours = ops.rms_norm(x, w, 1e-5)
    exact = (w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt())
    assert (ours.double() - exact).abs().max() <= 4 * 2.0 ** -24 * exact.abs().max()  # a few float32 roundings
    assert torch.allclose(ours, torch_rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    assert all(torch.equal(ops.rms_norm(x[i:i + 1], w, 1e-5), ours[i:i + 1]) for i in range(rows))


def test_model_rms_norm_takes_ops_for_float32_only():
    x, w = torch.randn(2, 64), torch.randn(64)
    assert torch.equal(model.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(model.rms_norm(xb, wb, 1e-6), wb * torch_rms_norm(xb.float(), torch.ones(64), 1e-6).bfloat16())


def config(nh: int, nkv: int, hd: int, rotary: int | None, window: int | None) -> ModelConfig:
    return ModelConfig("llama", hidden=nh * hd, intermediate=64, n_layers=1, n_heads=nh, n_kv_heads=nkv, head_dim=hd,
                       vocab=32, max_seq_len=64, rope_theta=10000.0, rotary_dim=rotary,
                       sliding_window=window, local_layers=(0,) if window else ())


def torch_attend(qkv, kv, pos, cfg, rope, scale, norms=None):
    """nodes/engine/model.py's torch ops for a segment of rows: per-head norms (model.rms_norm, itself held to torch's
    in test_rms_norm_is_torchs_to_rounding_and_a_row_is_its_own), RoPE, the KV write, row_attention.attend_rows."""
    t, nh, nkv, hd = qkv.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    heads = qkv.view(t, nh + 2 * nkv, hd).transpose(0, 1)
    qk = heads[:nh + nkv]
    if norms is not None:
        qk = torch.cat([model.rms_norm(qk[:nh].contiguous(), norms[0], 1e-6),
                        model.rms_norm(qk[nh:].contiguous(), norms[1], 1e-6)])
    q, k = rope.apply(qk, pos).split([nh, nkv])
    kv[0, :, pos:pos + t] = k
    kv[1, :, pos:pos + t] = heads[nh + nkv:]
    return attend_rows(q, kv[:, :, :pos + t], pos, rope.window, scale)


@pytest.mark.parametrize("nh, nkv, hd, rotary, window", [
    (9, 3, 64, None, None),  # SmolLM2's heads
    (4, 4, 16, 12, None),  # partial rotary (Phi-4-mini's 0.75), no GQA
    (8, 2, 24, None, 5),  # a local layer's window; a head width past 8 lanes by 8
    (2, 1, 10, None, None),  # a head width of no whole lanes
])
@pytest.mark.parametrize("pos, t", [(0, 1), (7, 1), (11, 5), (3, 17)])
@pytest.mark.parametrize("head_norms", [False, True])  # Qwen3's and Gemma 3's q_norm, k_norm
def test_attention_rows_are_torchs(nh, nkv, hd, rotary, window, pos, t, head_norms):
    cfg = config(nh, nkv, hd, rotary, window)
    rope = Rope(cfg, cfg.max_seq_len, torch.float32).layer(0)
    gen = torch.Generator().manual_seed(pos * 31 + t)
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen)
    held = torch.randn(2, nkv, cfg.max_seq_len, hd, generator=gen)  # earlier positions' keys and values
    norms = (1 + 0.3 * torch.randn(hd, generator=gen), 1 + 0.3 * torch.randn(hd, generator=gen)) if head_norms else None
    ours_kv, theirs_kv = held.clone(), held.clone()
    scale = hd ** -0.5
    ours = ops.attend_rows(qkv, rope.cos, rope.sin, ours_kv, pos, nh, rope.window, scale, *(norms or (None, None)),
                           1e-6)
    theirs = torch_attend(qkv, theirs_kv, pos, cfg, rope, scale, norms)
    assert torch.equal(ours_kv, theirs_kv)  # RoPE rounds as torch's ops: the same keys
    assert ours.shape == theirs.shape == (t, nh * hd)
    assert (ours - theirs).abs().max() <= 2e-6 * held.abs().max()
    for i in range(t):  # each row as a one-token step at its position computes it
        alone_kv = held.clone()
        alone_kv[:, :, pos:pos + i] = ours_kv[:, :, pos:pos + i]
        row = ops.attend_rows(qkv[i:i + 1], rope.cos, rope.sin, alone_kv, pos + i, nh, rope.window, scale,
                              *(norms or (None, None)), 1e-6)
        assert torch.equal(row, ours[i:i + 1]), i
