"""A Q4_K_M layer's wqkv (issue 27): its Q4_K wq and wk rows stay int4, their blocks as they are, beside its Q6_K wv
rows as int8; the v rows are what the import made of them before (a whole int8 wqkv) and the model's logits are as
near a float32 import of the same file or nearer; the C layer calls give the torch steps' bits on such a layer; the
memory plan and bits per weight count each piece's own bytes; stores of a whole int8 wqkv still load."""

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

import tools.import_gguf as importer
from nodes.engine import layer_calls, window_calls
from nodes.engine.formats import Format, weight_format
from nodes.engine.fused import layer_bytes
from nodes.engine.kernels import ops, q4
from nodes.engine.model import rms_norm
from nodes.engine.quant import BITS, FEW_ROWS, Int4, Int8, Rows, linear, machine_layout, pack_int4, quantize_int8
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from prima_rpc.spec.shapes import layer_params, matrix_params
from tests.test_quant_gguf_types import HEADS, KV, Q4_K_M, mixed_gguf
from tools.gguf_types import q4k_int4
from tools.import_gguf import import_gguf, unpermute

PROMPT = "The quick brown fox"


QKV = ("wq", "wk", "wv")


@pytest.mark.parametrize("fmt, pieces", [
    (Format("int4"), [("wqkv", "int4", QKV)]),
    (Format("int8"), [("wqkv", "int8", QKV)]),
    (Format("int4", int8=("wqkv",)), [("wqkv", "int8", QKV)]),  # stores written before per-part formats
    (Format("int4", int8=("wqkv", "wv")), [("wqkv", "int8", QKV)]),  # the widest of such a layer and a split one
    (Format("int4", int8=("wv",)), [("wqkv.0", "int4", ("wq", "wk")), ("wqkv.1", "int8", ("wv",))]),
    (Format("int4", int8=("wk",)), [("wqkv.0", "int4", ("wq",)), ("wqkv.1", "int8", ("wk",)),
                                    ("wqkv.2", "int4", ("wv",))]),
])
def test_a_matrix_is_one_piece_per_run_of_parts_in_one_format(fmt, pieces):
    assert [(p.name, p.fmt.name, p.parts) for p in fmt.pieces("wqkv")] == pieces


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A 4-layer Q4_K_M-like file (Q6_K attn_v and ffn_down in layers 1 and 3) imported three ways: as it is now
    (wqkv in pieces), as before (a whole int8 wqkv in those layers) and de-quantized to float32 (the reference)."""
    d = tmp_path_factory.mktemp("pieces")
    path = mixed_gguf(d / "q4km.gguf", Q4_K_M)
    pieces = import_gguf(path, d / "pieces")
    with pytest.MonkeyPatch.context() as m:
        before = tuple(("wqkv", "w_down") if i % 2 else () for i in range(4))  # a whole int8 wqkv, as imported before
        m.setattr(importer, "file_dtype", lambda g: ("int4", before))
        whole = import_gguf(path, d / "whole")
    return path, pieces, whole, import_gguf(path, d / "f32", dtype="float32")


@pytest.mark.slow  # the stores fixture imports a quantized file three ways
def test_q_and_k_rows_are_their_q4k_blocks_and_v_rows_the_int8_rows_of_before(stores):
    path, pieces, whole, _ = stores
    assert json.loads((pieces / "manifest.json").read_text())["quant"]["int8_layers"] == \
        [[], ["wv", "w_down"], [], ["wv", "w_down"]]
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    new, old = LayerStore(pieces).load("layer.1"), LayerStore(whole).load("layer.1")
    assert {n for n in new if n.startswith("wqkv")} == {"wqkv.0.qweight", "wqkv.0.scales", "wqkv.1.qweight",
                                                         "wqkv.1.scales"}
    qs, dms = [], []
    for g, heads in (("attn_q", HEADS), ("attn_k", KV)):  # q4k_int4: the int4 path of test_quant_gguf_types' checks
        t = tensors[f"blk.1.{g}.weight"]
        q, dm = q4k_int4(t.data, int(t.shape[1]), int(t.shape[0]))
        qs.append(unpermute(q, heads))
        dms.append(unpermute(dm.transpose(0, 1), heads).transpose(0, 1))
    assert torch.equal(new["wqkv.0.qweight"], pack_int4(torch.cat(qs), machine_layout()))
    assert torch.equal(new["wqkv.0.scales"], torch.cat(dms, dim=1))
    v = tensors["blk.1.attn_v.weight"]
    q, scale = quantize_int8(torch.from_numpy(np.array(dequantize(v.data, v.tensor_type))))
    rows = slice(old["wqkv.qweight"].shape[0] - q.shape[0], None)  # the whole int8 wqkv's v rows: the same
    assert torch.equal(new["wqkv.1.qweight"], q) and torch.equal(old["wqkv.qweight"][rows], q)
    assert torch.equal(new["wqkv.1.scales"], scale) and torch.equal(old["wqkv.scales"][rows], scale)


@pytest.mark.slow  # the stores fixture imports a quantized file three ways
def test_logits_are_as_near_the_float32_import_or_nearer(stores):
    """Against the float32 import of the same file (its de-quantized weights): layer 1's q and k products nearer
    than a whole int8 wqkv's (their Q4_K weights kept, within float16's rounding of their scales, where int8 rows
    err by up to half a step of a row's scale), its v products the same bits; the logits over the prompt within 1 %
    of the largest (the int8 embedding and activations' own errors dominate them), their KL no worse (1 % slack for
    noise), and 6 greedy tokens the float32 import's."""
    _, pieces, whole, f32 = stores
    models = {name: ReferenceModel(s, torch.float32) for name, s in (("pieces", pieces), ("whole", whole),
                                                                      ("f32", f32))}
    assert isinstance(models["pieces"].layers[1].wqkv, Rows) and isinstance(models["whole"].layers[1].wqkv, Int8)
    ids = models["f32"].codec.prompt_ids(PROMPT)
    ref = models["f32"]
    x = rms_norm(ref.hidden(ids, 0, ref.new_cache(len(ids)), 0, 1), ref.layers[1].attn_norm, ref.cfg.norm_eps)
    qk = (HEADS + KV) * ref.cfg.head_dim  # wqkv's q and k rows
    new, old, exact = (linear(x, models[n].layers[1].wqkv) for n in ("pieces", "whole", "f32"))
    assert (new - exact)[:, :qk].abs().max() < (old - exact)[:, :qk].abs().max() / 4
    assert torch.equal(new[:, qk:], old[:, qk:])
    logits = {n: m.step_all(ids, 0, m.new_cache(len(ids))) for n, m in models.items()}
    kl = {}
    for name in ("pieces", "whole"):
        assert (logits[name] - logits["f32"]).abs().max() < 1e-2 * logits["f32"].abs().max()
        p, q = logits["f32"].log_softmax(-1), logits[name].log_softmax(-1)
        kl[name] = (p.exp() * (p - q)).sum(-1).mean().item()
    assert kl["pieces"] <= 1.01 * kl["whole"], kl
    steps = {name: [t.token_id for t in m.generate_ids(ids, GenerateParams(max_tokens=6))]
             for name, m in models.items()}
    assert steps["pieces"] == steps["f32"], steps


@pytest.mark.slow  # the stores fixture imports a quantized file three ways
@pytest.mark.skipif(not (ops.available() and q4.available()), reason="ops.c and q4.c build on x86 AVX2+ and aarch64")
def test_the_layer_calls_give_the_torch_steps_bits_on_a_layer_of_pieces(stores, monkeypatch):
    model = ReferenceModel(stores[1], torch.float32)
    ids = model.codec.prompt_ids(PROMPT)[:FEW_ROWS]  # few rows: each layer through its two C calls
    ours = model.step_all(ids, 0, model.new_cache(len(ids)))
    assert model.layers[1].bound is not None and model.layers[1].bound.matrices is not None
    monkeypatch.setattr(layer_calls, "forward", lambda *args: None)
    monkeypatch.setattr(window_calls, "forward", lambda *args: None)
    assert torch.equal(ours, model.step_all(ids, 0, model.new_cache(len(ids))))


@pytest.mark.slow  # the stores fixture imports a quantized file three ways
def test_memory_and_bits_count_each_pieces_bytes(stores):
    """A layer's memory (fused.layer_bytes: the profiler's and the memory plan's) is its unit's matrix bytes, the
    store's widest its largest layer's; bits per weight count each piece in its format (quant.BITS)."""
    _, pieces, whole, _ = stores
    for store in (pieces, whole):
        s = LayerStore(store)
        cfg, fmt = s.manifest.config, weight_format(s.manifest)
        small = (layer_params(cfg) - matrix_params(cfg)) * 4
        on_disk, bits, weights = [], 0.0, 0
        for i in range(cfg.n_layers):
            matrices = {n: v for n, v in s.load(f"layer.{i}").items() if n.endswith((".qweight", ".scales"))}
            on_disk.append(sum(v.nbytes for v in matrices.values()))
            assert layer_bytes(cfg, torch.float32, fmt.layer(i)) == small + on_disk[-1]
            for q in (v for n, v in matrices.items() if n.endswith(".qweight")):
                count = q.numel() * (1 if q.dtype == torch.int8 else 2)  # int4: two weights a byte
                bits += BITS["int8" if q.dtype == torch.int8 else "int4"] * count
                weights += count
        assert layer_bytes(cfg, torch.float32, fmt) == small + max(on_disk)  # the widest: layers 1 and 3's
        assert s.manifest.bits_per_weight == pytest.approx(bits / weights)
    assert LayerStore(pieces).entry("layer.1").bytes < LayerStore(whole).entry("layer.1").bytes


@pytest.mark.slow  # the stores fixture imports a quantized file three ways
def test_bfloat16_activations_take_torchs_kernels_piece_by_piece(stores):
    """Where a machine runs int4 in bfloat16 (nodes/engine/dtype_choice.py) each piece goes through torch's kernel
    of its format: the logits stay within bfloat16's reach of the float32 activations' (8 bits a value)."""
    model, ref = ReferenceModel(stores[1], torch.bfloat16), ReferenceModel(stores[1], torch.float32)
    wqkv = model.layers[1].wqkv
    assert isinstance(wqkv, Rows) and [type(p) for p in wqkv.pieces] == [Int4, Int8]
    ids = ref.codec.prompt_ids(PROMPT)
    ours, theirs = (m.step(ids, 0, m.new_cache(len(ids))) for m in (model, ref))
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
