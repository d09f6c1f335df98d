"""A decode step's layer as two C calls (nodes/engine/layer_calls.py) gives model.layer_forward's torch steps' bits:
the layer's output and every KV cache, for each kind of matrix our kernels take (and matrices of int4 rows above
int8 ones), a bias, post norms, a local window, and batches of segments; and it stands aside where it does not
apply."""

import pytest
import torch

from nodes.engine import layer_calls, window_calls
from nodes.engine.kernels import f32, ops, q4
from nodes.engine.model import KVCache, Layer, Segment, layer_forward, run_layers
from nodes.engine.quant import (
    Int4,
    Int8,
    Rows,
    machine_layout,
    onednn_int8_exact,
    pack_int4,
    quantize_int4,
    quantize_int8,
)
from nodes.engine.rope import Rope
from prima_rpc.spec.manifest import ModelConfig

pytestmark = pytest.mark.skipif(not (ops.available() and q4.available() and f32.available()),
                                reason="ops.c, q4.c and f32.c build on x86 with AVX2 and up and on aarch64 only: "
                                       "elsewhere a layer runs model.py's torch steps, which test_model and "
                                       "test_batch_invariance cover")
NH, NKV, HD, HIDDEN, INTER = 6, 2, 16, 96, 128


def config(window: int | None = None, n_layers: int = 1, local: tuple[int, ...] = (0,), arch: str = "llama",
           ) -> ModelConfig:
    return ModelConfig(arch, hidden=HIDDEN, intermediate=INTER, n_layers=n_layers, n_heads=NH, n_kv_heads=NKV,
                       head_dim=HD, vocab=32, max_seq_len=64, rope_theta=10000.0, sliding_window=window,
                       local_layers=local if window else ())


def matrix(kind: str, n: int, k: int, gen: torch.Generator, int8_rows: int = 0):
    if kind == "split":  # int4 rows above int8 ones, as a Q4_K_M layer's Q4_K wq, wk above its Q6_K wv (quant.Rows)
        top = n - (int8_rows or n // 4)
        return Rows([matrix("int4", top, k, gen), matrix("int8", n - top, k, gen)])
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    if kind == "float32":
        return w
    if kind == "int4":
        q, dm = quantize_int4(w)
        return Int4.from_dm(pack_int4(q, machine_layout()), dm, torch.float32, machine_layout())
    return Int8(*quantize_int8(w), torch.float32)  # oneDNN's from ONEDNN_MIN_WEIGHTS weights, where exact


def layer(kind: str, bias: bool = False, post_norms: bool = False, seed: int = 0, head_norms: bool = False) -> Layer:
    gen = torch.Generator().manual_seed(seed)
    norm = lambda n: 1 + 0.1 * torch.randn(n, generator=gen)  # noqa: E731
    qkv = (NH + 2 * NKV) * HD
    return Layer(attn_norm=norm(HIDDEN), wqkv=matrix(kind, qkv, HIDDEN, gen, int8_rows=NKV * HD),
                 bqkv=0.1 * torch.randn(qkv, generator=gen) if bias else None, wo=matrix(kind, HIDDEN, NH * HD, gen),
                 ffn_norm=norm(HIDDEN), w_gate_up=matrix(kind, 2 * INTER, HIDDEN, gen),
                 w_down=matrix(kind, HIDDEN, INTER, gen), post_attn_norm=norm(HIDDEN) if post_norms else None,
                 post_ffn_norm=norm(HIDDEN) if post_norms else None, q_norm=norm(HD) if head_norms else None,
                 k_norm=norm(HD) if head_norms else None)


def run(x, lay, spans, kvs, cfg, rope, calls: bool, monkeypatch):
    """layer_forward over segments spans [(pos, t)] with caches kvs (cloned): (output, caches), through the C calls
    or (calls False) the torch steps alone."""
    kvs = [kv.clone() for kv in kvs]
    with monkeypatch.context() as m:
        if not calls:
            m.setattr(layer_calls, "forward", lambda *args: None)
        out = layer_forward(x, lay, [Segment(kv, pos, t) for kv, (pos, t) in zip(kvs, spans, strict=True)], cfg, rope)
    return out, kvs


KINDS = ["float32", "int4", "int8", "split"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias, post_norms, window, head_norms", [
    (False, False, None, False), (True, False, None, False), (False, True, None, False), (False, False, 4, False),
    (False, True, 4, True),  # Gemma 3's: post norms, per-head norms, a local window
])
@pytest.mark.parametrize("spans", [[(0, 1)], [(9, 1)], [(5, 4)], [(3, 1), (12, 5), (0, 2)]])
def test_two_calls_give_the_torch_steps_bits(kind, bias, post_norms, window, head_norms, spans, monkeypatch):
    cfg, lay = config(window), layer(kind, bias, post_norms, head_norms=head_norms)
    rope = Rope(cfg, cfg.max_seq_len, torch.float32).layer(0)
    gen = torch.Generator().manual_seed(len(spans))
    kvs = [torch.randn(2, NKV, cfg.max_seq_len, HD, generator=gen) for _ in spans]
    x = torch.randn(sum(t for _, t in spans), HIDDEN, generator=gen)
    assert layer_calls.fits(x, lay, [Segment(kv, p, t) for kv, (p, t) in zip(kvs, spans, strict=True)], rope)
    ours, ours_kv = run(x, lay, spans, kvs, cfg, rope, True, monkeypatch)
    theirs, theirs_kv = run(x, lay, spans, kvs, cfg, rope, False, monkeypatch)
    assert lay.bound is not None and lay.bound.matrices is not None  # the C calls ran
    assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours_kv, theirs_kv, strict=True))


def test_a_layer_whose_weights_are_replaced_is_bound_again(monkeypatch):
    cfg, lay = config(), layer("int4")
    rope = Rope(cfg, cfg.max_seq_len, torch.float32)
    kv, x = torch.zeros(2, NKV, cfg.max_seq_len, HD), torch.randn(1, HIDDEN)
    run(x, lay, [(0, 1)], [kv], cfg, rope, True, monkeypatch)
    first = lay.bound
    lay.w_down = layer("int4", seed=1).w_down
    ours, _ = run(x, lay, [(0, 1)], [kv], cfg, rope, True, monkeypatch)
    assert lay.bound is not first and lay.bound.held[3] is lay.w_down
    assert torch.equal(ours, run(x, lay, [(0, 1)], [kv], cfg, rope, False, monkeypatch)[0])


@pytest.mark.skipif(not onednn_int8_exact(), reason="oneDNN's int8 sums saturate here (no VNNI): no int8 matrix "
                    "takes oneDNN on this machine, so the C calls meet none")
def test_onednn_int8_matrices_run_the_torch_steps(monkeypatch):
    monkeypatch.setattr("nodes.engine.quant.ONEDNN_MIN_WEIGHTS", 0)
    cfg, lay = config(), layer("int8")
    assert lay.wqkv.onednn
    rope, kv = Rope(cfg, cfg.max_seq_len, torch.float32), torch.zeros(2, NKV, cfg.max_seq_len, HD)
    x = torch.randn(1, HIDDEN)
    assert layer_calls.forward(x, lay, [Segment(kv, 0, 1)], cfg, rope) is None
    assert lay.bound.matrices is None


def test_what_the_calls_do_not_take_runs_the_torch_steps(monkeypatch):
    """bfloat16 rows, more than FEW_ROWS rows and a segment past its cache go through model.py's steps (the C calls
    return None for them)."""
    cfg = config()
    rope = Rope(cfg, cfg.max_seq_len, torch.float32)
    kv = torch.zeros(2, NKV, cfg.max_seq_len, HD)
    segs = lambda t, pos=0: [Segment(kv, pos, t)]  # noqa: E731
    lay = layer("int4")
    assert layer_calls.forward(torch.randn(1, HIDDEN).bfloat16(), lay, segs(1), cfg, rope) is None
    assert layer_calls.forward(torch.randn(9, HIDDEN), lay, segs(9), cfg, rope) is None
    assert layer_calls.forward(torch.randn(2, HIDDEN), lay, segs(2, cfg.max_seq_len - 1), cfg, rope) is None


def window_setup(kind: str, bias: bool, post_norms: bool, head_norms: bool, spans, window: int | None = 4):
    """Layers 1-4 of a 5-layer model (layer 2 local where there is a window), caches of each span's request with
    random earlier keys and values, and rows."""
    cfg = config(window, n_layers=5, local=(2,))
    layers = {i: layer(kind, bias, post_norms, seed=i, head_norms=head_norms) for i in range(1, 5)}
    gen = torch.Generator().manual_seed(len(spans))
    caches = [KVCache(list(range(1, 5)), cfg, cfg.max_seq_len, torch.float32) for _ in spans]
    for c in caches:
        for kv in c.kv.values():
            kv.copy_(torch.randn(kv.shape, generator=gen))
    x = torch.randn(sum(t for _, t in spans), HIDDEN, generator=gen)
    return cfg, layers, Rope(cfg, cfg.max_seq_len, torch.float32), caches, x


def layer_by_layer(x, layers, start, stop, caches, spans, cfg, rope):
    for i in range(start, stop):
        segs = [Segment(c.kv[i], pos, t) for c, (pos, t) in zip(caches, spans, strict=True)]
        x = layer_forward(x, layers[i], segs, cfg, rope.layer(i))
    return x


def clone(caches: list[KVCache]) -> list[KVCache]:
    out = []
    for c in caches:
        new = object.__new__(KVCache)
        new.__dict__.update(c.__dict__, kv={i: kv.clone() for i, kv in c.kv.items()}, runs={})
        out.append(new)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias, post_norms, window, head_norms", [
    (False, False, None, False), (True, False, 4, False), (False, True, 4, True),  # Gemma 3's norms, a local layer
])
@pytest.mark.parametrize("spans", [[(0, 1)], [(9, 1)], [(5, 4)], [(3, 1), (12, 5), (0, 2)]])
def test_a_window_call_gives_the_layer_by_layer_bits(kind, bias, post_norms, window, head_norms, spans,
                                                     monkeypatch):
    """Layers 1-4 as one call equal layer_forward's two C calls a layer, and its torch steps, output and caches."""
    cfg, layers, rope, caches, x = window_setup(kind, bias, post_norms, head_norms, spans, window)
    ours_caches, theirs_caches, torch_caches = clone(caches), clone(caches), clone(caches)
    ours = window_calls.forward(x, layers, 1, 5, [(c, p, t) for c, (p, t) in zip(ours_caches, spans)], cfg, rope)
    assert ours is not None
    theirs = layer_by_layer(x, layers, 1, 5, theirs_caches, spans, cfg, rope)
    with monkeypatch.context() as m:
        m.setattr(layer_calls, "forward", lambda *args: None)
        torch_steps = layer_by_layer(x, layers, 1, 5, torch_caches, spans, cfg, rope)
    assert torch.equal(ours, theirs) and torch.equal(ours, torch_steps)
    for a, b, c in zip(ours_caches, theirs_caches, torch_caches, strict=True):
        assert all(torch.equal(a.kv[i], b.kv[i]) and torch.equal(a.kv[i], c.kv[i]) for i in range(1, 5))


def test_a_window_is_bound_once_and_again_when_a_layer_changes():
    cfg, layers, rope, caches, x = window_setup("int4", False, False, False, [(0, 1)])
    run_layers(x, layers, 1, 5, caches[0], 0, cfg, rope)
    run, kv = layers[1].runs[5], caches[0].runs[(1, 5)]
    run_layers(x, layers, 1, 5, caches[0], 1, cfg, rope)
    assert layers[1].runs[5] is run and caches[0].runs[(1, 5)] is kv
    layers[3].w_down = layer("int4", seed=9).w_down  # new weights: bound again, and used
    theirs = layer_by_layer(x, layers, 1, 5, clone(caches), [(2, 1)], cfg, rope)
    assert torch.equal(run_layers(x, layers, 1, 5, caches[0], 2, cfg, rope), theirs)
    assert layers[1].runs[5] is not run and layers[1].runs[5].bounds[2].held[3] is layers[3].w_down
    layers[2] = layer("int4", seed=10)  # a new layer object
    theirs = layer_by_layer(x, layers, 1, 5, clone(caches), [(3, 1)], cfg, rope)
    assert torch.equal(run_layers(x, layers, 1, 5, caches[0], 3, cfg, rope), theirs)
    assert layers[1].runs[5].layers[1] is layers[2]


def test_what_the_window_call_does_not_take_runs_layer_by_layer():
    """bfloat16 rows, more than FEW_ROWS rows, a segment past a cache (a local layer's ring) or longer than
    ROW_ATTENTION, a missing layer, a mixture of experts, gelu (Gemma): None, the caller runs layer by layer."""
    cfg, layers, rope, caches, x = window_setup("int4", False, False, False, [(0, 1)])
    spans = lambda pos, t: [(caches[0], pos, t)]  # noqa: E731
    assert window_calls.forward(x, layers, 1, 5, spans(0, 1), cfg, rope) is not None
    assert window_calls.forward(x.bfloat16(), layers, 1, 5, spans(0, 1), cfg, rope) is None
    assert window_calls.forward(torch.randn(9, HIDDEN), layers, 1, 5, spans(0, 9), cfg, rope) is None
    ring = caches[0].kv[2].shape[2]
    assert ring < cfg.max_seq_len
    assert window_calls.forward(x, layers, 1, 5, spans(ring, 1), cfg, rope) is None  # layer 2's ring has wrapped
    assert window_calls.forward(x, layers, 3, 5, spans(ring, 1), cfg, rope) is not None  # layers 3, 4: no ring
    assert window_calls.forward(x, layers, 0, 5, spans(0, 1), cfg, rope) is None  # no layer 0 here
    gemma = config(4, n_layers=5, local=(2,), arch="gemma3")
    assert gemma.arch.act == "gelu_tanh"
    assert window_calls.forward(x, layers, 1, 5, spans(0, 1), gemma, rope) is None
    cfg, layers, rope, caches, x = window_setup("int4", False, False, False, [(0, 1)])
    layers[4].moe = object()  # as a mixture's layer holds (its w_gate_up is None)
    assert window_calls.forward(x, layers, 1, 5, spans(0, 1), cfg, rope) is None
