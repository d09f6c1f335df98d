"""Quantized stores: int4 packing, exact GGUF Q4_1 weights, SmolLM2 in int4, shards and rings on int4 stores.

Every check holds on any x86 CPU torch runs on (AVX-512 or AVX2, with or without VNNI and native bfloat16): each
states what its kernel path guarantees there. Run them under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 to
see an AVX2 machine's paths on this one."""

import json
import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from nodes.engine.dtype_choice import compute_dtype
from nodes.engine.formats import weight_format
from nodes.engine.fused import head_bytes, kv_bytes, layer_bytes
from nodes.engine.kernels.q4 import Q4Rows
from nodes.engine.model import Layer
from nodes.engine.prefetch import KV_RESERVE_TOKENS
from nodes.engine.quant import (
    LAYOUTS,
    ONEDNN_MIN_WEIGHTS,
    Int4,
    Int8,
    gguf_q4,
    kernel_scales,
    machine_layout,
    onednn_int8_exact,
    pack_int4,
    quantize_int8,
    unpack_int4,
)
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from nodes.generation.speculate import SpeculateParams, Speculator
from nodes.generation.state import GenerateParams
from prima_rpc.app import ring
from prima_rpc.app.status_rows import status_row
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.windows import Windows
from tests.rings import collect, collect_all, greedy_reference, local_ring
from tests.shards import ring_step
from tests.subprocesses import run_python
from tools.default_model import default_gguf, ensure_default_store
from tools.import_gguf import import_gguf
from tools.synth import synth

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "List three prime numbers.",
           "Explain gravity to a child.", "Translate 'good morning' into Spanish."]


@pytest.fixture(scope="session")
def smol_int4() -> Path:
    return ensure_default_store(dtype="int4")


@pytest.fixture(scope="session")
def tiny_int4(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("stores") / "tiny-int4", "tiny", seed=3, dtype="int4")


# ------------------------------------------------------------------ the packed layout and the kernels


@pytest.mark.parametrize("rows", [16, 48, 64, 112, 960])
def test_our_packing_is_the_kernels_and_unpacks(rows):
    q = torch.randint(0, 16, (rows, 64), dtype=torch.uint8)
    assert torch.equal(pack_int4(q, machine_layout()), torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))
    for layout in LAYOUTS:
        packed = pack_int4(q, layout)
        assert torch.equal(unpack_int4(packed, layout), q)
        assert torch.equal(unpack_int4(packed, layout, torch.tensor([rows - 1, 0, 3])), q[[rows - 1, 0, 3]])


def test_int4_rows_and_matmul_see_the_same_weights():
    q = torch.randint(0, 16, (128, 96), dtype=torch.uint8)
    dm = torch.stack([torch.rand(3, 128) * 0.1, -torch.rand(3, 128)], dim=-1).half()
    for dtype in (torch.float32, torch.bfloat16):
        w = Int4.from_dm(pack_int4(q, LAYOUTS[1]), dm, dtype, LAYOUTS[1])  # another machine's layout: repacked
        seen = w.mm(torch.eye(96, dtype=dtype)).t()  # [N, K]: what the kernel multiplies by
        assert torch.equal(w.rows(torch.arange(128)), seen)


@pytest.mark.parametrize("shape", [(64, 96), (2048, 2048)])  # the int8pack kernel; oneDNN's size (ONEDNN_MIN_WEIGHTS)
def test_int8_matmul_is_its_dequantized_weights(shape):
    """Both int8 paths guarantee the same: the weights the kernel multiplies by are q * scale exactly (an identity
    matmul returns them, rounded once to bfloat16), a row's result does not depend on the other rows, and the
    bfloat16 result is within 1 % of the exact product. The large matrix takes oneDNN only where its int32 sums
    are exact (VNNI); elsewhere (AVX2) the int8pack kernel, with the same guarantees."""
    w = torch.randn(*shape)
    q, scale = quantize_int8(w)
    weight = Int8(q, scale, torch.bfloat16)
    assert weight.onednn == (w.numel() >= ONEDNN_MIN_WEIGHTS and onednn_int8_exact())
    seen = weight.mm(torch.eye(shape[1], dtype=torch.bfloat16)).t().float()
    assert torch.equal(seen, (q.float() * scale[:, None]).bfloat16().float())
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] * 0.501).all()  # half a step at most
    x = torch.randn(8, shape[1]).bfloat16()
    y = weight.mm(x)
    assert torch.equal(y, torch.cat([weight.mm(row) for row in x.split(1)]))
    exact = x.float() @ (q.float() * scale[:, None]).t()
    assert ((y.float() - exact).abs().max() / exact.abs().max()) < 0.01  # the bfloat16 result: 0.2 % / 0.3 %
    if weight.onednn:  # packed for oneDNN: the values are held once
        assert weight.q is None and weight.nbytes() == q.numel() + scale.numel() * 2


@pytest.mark.skipif(not onednn_int8_exact(), reason="oneDNN's u8 x s8 kernel saturates int16 pair sums without VNNI "
                    "(this CPU, or ONEDNN_MAX_CPU_ISA): int8 takes the int8pack kernel there, which "
                    "test_int8_matmul_is_its_dequantized_weights covers")
def test_onednn_int8_sums_are_exact_with_vnni():
    """With VNNI the oneDNN path's only error is its activations' two int8 terms (~14 bits a row): in float32
    within 1e-4 of the exact product (measured 3e-5)."""
    w = torch.randn(2048, 2048)
    q, scale = quantize_int8(w)
    weight = Int8(q, scale, torch.float32)
    assert weight.onednn
    x = torch.randn(8, 2048)
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()
    assert ((weight.mm(x).double() - exact).abs().max() / exact.abs().max()) < 1e-4


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="ONEDNN_MAX_CPU_ISA=AVX2 is x86's")
def test_the_onednn_probe_sees_saturating_sums_under_avx2():
    """Limited to AVX2 (no VNNI), oneDNN's int8 sums saturate: the probe says so, and int8 leaves oneDNN."""
    code = ("import torch; from nodes.engine.quant import Int8, onednn_int8_exact; "
            "print(onednn_int8_exact(), Int8(torch.ones(4096, 2048, dtype=torch.int8), torch.ones(4096), "
            "torch.bfloat16).onednn)")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert run_python(code, env=env, timeout=120).split() == ["False", "False"]


# ------------------------------------------------------------------ SmolLM2 from its Q4_1 GGUF


@pytest.mark.slow
def test_int4_weights_equal_the_ggufs_on_every_layer(smol_int4):
    """Every layer's packed weights, de-quantized as the kernel lays them out, equal gguf's de-quantized Q4_1
    weights bit for bit (float32 activations); on three layers also read back through the kernel itself (an
    identity matmul: nodes/engine/kernels/q4.c where it builds). With bfloat16 activations scale and zero are
    bfloat16."""
    tensors = {t.name: t for t in GGUFReader(default_gguf()).tensors}
    store = LayerStore(smol_int4)
    cfg, fmt = store.config, weight_format(store.manifest)
    through_kernel = {0, cfg.n_layers // 2, cfg.n_layers - 1}
    parts = {"wo": ["attn_output"], "w_down": ["ffn_down"], "w_gate_up": ["ffn_gate", "ffn_up"],
             "wqkv": ["attn_q", "attn_k", "attn_v"]}
    worst = 0.0
    for i in range(cfg.n_layers):
        unit = store.load(f"layer.{i}")
        f32, b16 = Layer.from_unit(unit, torch.float32, fmt), Layer.from_unit(unit, torch.bfloat16, fmt)
        for name, gnames in parts.items():
            ts = [tensors[f"blk.{i}.{g}.weight"] for g in gnames]
            assert all(t.tensor_type.name == "Q4_1" for t in ts)
            ref = []
            for g, t in zip(gnames, ts):
                w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))
                if g in ("attn_q", "attn_k"):  # llama.cpp's row order for its RoPE, undone by the importer
                    from tools.import_gguf import unpermute
                    w = unpermute(w, cfg.n_heads if g == "attn_q" else cfg.n_kv_heads)
                ref.append(w)
            ref = torch.cat(ref)
            weight = getattr(f32, name)
            assert isinstance(weight, Int4 | Q4Rows)  # float32: our kernel where it builds (tests/test_kernels.py)
            assert torch.equal(weight.rows(torch.arange(ref.shape[0])), ref), f"layer {i} {name}"
            if i in through_kernel:
                assert torch.equal(weight.mm(torch.eye(ref.shape[1])).t(), ref), f"layer {i} {name} (kernel)"
                seen = getattr(b16, name).mm(torch.eye(ref.shape[1], dtype=torch.bfloat16)).t().float()
                worst = max(worst, ((seen - ref).abs().max() / ref.abs().max()).item())
    assert worst < 0.01  # bfloat16 scales: under 1 % of a matrix's largest weight (measured 0.6 %)


@pytest.mark.slow  # quantizes SmolLM2's matrices
def test_gguf_q4_blocks_map_exactly():
    """Q4_0 and Q4_1 blocks of the real GGUF and of hand-made Q4_0 blocks: d q + m, as gguf computes."""
    t = next(t for t in GGUFReader(default_gguf()).tensors if t.tensor_type.name == "Q4_1")
    n, k = int(t.shape[1]), int(t.shape[0])
    q, dm = gguf_q4(t.data, "Q4_1", n, k)
    w = Int4.from_dm(pack_int4(q, machine_layout()), dm, torch.float32, machine_layout())
    assert torch.equal(w.rows(torch.arange(n)), torch.from_numpy(dequantize(t.data, t.tensor_type)))
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    blocks = quantize(x, Q.Q4_0)
    q, dm = gguf_q4(blocks, "Q4_0", 64, 96)
    w = Int4.from_dm(pack_int4(q, machine_layout()), dm, torch.float32, machine_layout())
    assert torch.equal(w.rows(torch.arange(64)), torch.from_numpy(dequantize(blocks, Q.Q4_0)))


@pytest.mark.slow
@pytest.mark.parametrize("activations", [None, "float32"])  # the machine's choice; float32 (q4.c where it builds)
def test_int4_smollm2_answers_paris_and_mostly_agrees_with_float32(smol_int4, smol_store, activations):
    """Agreement that does not hang on near-ties (whose side differs by ISA: the AVX2 and AVX-512 int4 kernels round
    differently): fed float32's own greedy tokens, int4 predicts each of them on most positions, and where it does
    not, float32's token is within 1.0 of int4's top logit (bfloat16 logits step by 0.125 near 20; measured at
    most 0.25, and 84 of 89 positions, on AVX-512 and under AVX2 emulation alike)."""
    int4, ref = ReferenceModel(smol_int4, dtype=activations and getattr(torch, activations)), ReferenceModel(smol_store)
    assert int4.dtype == getattr(torch, activations or compute_dtype("int4"))  # by default the machine's choice
    manifest = json.loads((smol_int4 / "manifest.json").read_text())
    assert manifest["dtype"] == "int4" and manifest["files"]["layers"][0]["format"] == "int4"
    assert manifest["files"]["embed"]["format"] == "int8"  # the GGUF's embedding is Q8_0: int8 rows, not int4
    text = "".join(t.text for t in int4.generate(PROMPTS[0], GenerateParams(max_tokens=16)))
    assert "Paris" in text
    agree, positions, worst = 0, 0, 0.0
    for prompt in PROMPTS:
        ids = int4.codec.prompt_ids(prompt)
        expected = [t.token_id for t in ref.generate(prompt, GenerateParams(max_tokens=24))]
        logits = int4.step_all(ids + expected[:-1], 0, int4.new_cache(len(ids) + len(expected)))[len(ids) - 1:]
        agree += sum(int(logits[i].argmax()) == t for i, t in enumerate(expected))
        positions += len(expected)
        worst = max(worst, max((logits[i].max() - logits[i, t]).item() for i, t in enumerate(expected)))
    assert agree >= 0.85 * positions, f"int4 predicts float32's token at only {agree} of {positions} positions"
    assert worst <= 1.0, f"float32's token is {worst:.3f} below int4's top logit"


@pytest.mark.slow
def test_int4_greedy_tokens_do_not_depend_on_speculation(smol_int4):
    """Verify frames compute each position as a one-token step does (nodes/engine/model.py ROW_ATTENTION): before,
    bfloat16 SDPA over several queries flipped a near-tie on the haiku prompt at its 13th token."""
    model = ReferenceModel(smol_int4)
    ngram = SpeculateParams("ngram", 4)
    total = Speculator(ngram)
    for prompt in PROMPTS + ["Count from one to twenty in words.",
                             "List the days of the week, then list them again in reverse."]:
        plain = [t.token_id for t in model.generate(prompt, GenerateParams(max_tokens=48))]
        spec = Speculator(ngram)
        fast = [t.token_id for t in model.generate(prompt, GenerateParams(max_tokens=48, speculate=ngram), spec=spec)]
        assert fast == plain, prompt
        total.update(spec.drafted, spec.accepted)
    assert 0 < total.accepted < total.drafted  # drafts accepted and rejected: both paths taken


# ------------------------------------------------------------------ shards, streaming and rings on int4


@pytest.mark.parametrize("ranges, budget, buffer_layers", [
    ([[(0, 8)]], 0, 0),                                 # one node, everything resident
    ([[(0, 8)]], 1, 0),                                 # one node streaming through a one-layer budget
    ([[(4, 6)], [(0, 2)], [(2, 4), (6, 8)]], 0, 0),     # 3 nodes, k = 2
    ([[(4, 6)], [(0, 2)], [(2, 4), (6, 8)]], 1, 0),     # ... streaming
    ([[(0, 8)]], 3.4, 1.3),                             # 3.4 layers beside an odd buffer: partly resident
], ids=["1node", "1node-stream", "3nodes-k2", "3nodes-k2-stream", "partial"])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_shards_equal_the_reference(kind, ranges, budget, buffer_layers, tiny_int4, tmp_path_factory,
                                              monkeypatch):
    """int8: every matrix through oneDNN where its sums are exact (its threshold lowered), packed on each use when
    streamed; elsewhere through the int8pack kernel."""
    if kind == "int8":
        monkeypatch.setattr("nodes.engine.quant.ONEDNN_MIN_WEIGHTS", 0)
        tiny = synth(tmp_path_factory.mktemp("stores") / "tiny-int8", "tiny", seed=3, dtype="int8")
    else:
        tiny = tiny_int4
    ref = ReferenceModel(tiny)
    assert isinstance(ref.layers[0].wqkv, Int8) == (kind == "int8")
    assert getattr(ref.layers[0].wqkv, "onednn", False) == (kind == "int8" and onednn_int8_exact())
    store = LayerStore(tiny)
    cfg, fmt = store.config, weight_format(store.manifest)
    layer = layer_bytes(cfg, ref.dtype, fmt)
    buffer = int(buffer_layers * layer)
    if buffer_layers:
        fixed = head_bytes(cfg, ref.dtype, weight_format(store.manifest, "embed")) + kv_bytes(
            cfg, ref.dtype, cfg.n_layers, min(KV_RESERVE_TOKENS, cfg.max_seq_len))
        budget = fixed + int(budget * layer) + buffer
    shards = [Shard(LayerStore(tiny), Windows(tuple(r), ref.cfg.n_layers, i == 0), ref.dtype, budget=budget,
                    buffer=buffer) for i, r in enumerate(ranges)]
    try:
        ids = ref.codec.prompt_ids("The quick brown fox")
        cache = ref.new_cache(len(ids) + 6)
        caches = [s.cache_for("r", 0, len(ids) + 6, len(ids)) for s in shards]
        pos = 0
        for _ in range(6):
            expected = ref.step(ids, pos, cache)
            assert torch.equal(ring_step(shards, caches, ids, pos), expected)
            pos, ids = pos + len(ids), [int(expected.argmax())]
        if budget:
            assert all(s.plan.streamed and s.prefetcher.misses == 0 for s in shards)
            assert all(s.resident_bytes() <= s.plan.budget for s in shards)
            # The buffer holds quantized units: about a quarter (int4) or half (int8) of a bfloat16 layer's bytes.
            ratio = shards[0].plan.layer_bytes / layer_bytes(store.config, torch.bfloat16)
            assert ratio < (0.4 if kind == "int4" else 0.6)
        if buffer_layers:
            assert any(len(units) < 4 for _, units in shards[0].plan.streamed) and shards[0].kept
    finally:
        for s in shards:
            s.close()


@pytest.mark.slow
@pytest.mark.parametrize("windows, budget", [
    ([30], None), ([10, 10, 10], None), ([7, 3, 5], None), ([10, 10, 0, 10], None), ([10, 10, 10], "1"),
], ids=["1node", "3nodes", "3nodes-k2", "relay", "3nodes-stream"])
def test_int4_ring_equals_the_single_process(smol_int4, tmp_path, windows, budget):
    expected = greedy_reference(smol_int4, PROMPTS[:2], 12)
    extra = [["--mem-budget", budget]] * len(windows) if budget else None
    with local_ring(smol_int4, len(windows), tmp_path, windows, extra_args=extra) as local:
        for prompt, tokens in expected.items():
            assert collect(local.addresses[0], prompt, 12)[0] == tokens, (windows, prompt)
        if budget:
            assert all(info.stats.disk_read_bytes > 0 for _, info in ring.walk(local.addresses[0]) if info.windows)


@pytest.mark.slow
def test_an_int4_ring_gives_a_request_its_plain_tokens_with_speculation_and_in_a_batch(smol_int4, tmp_path):
    """All prompts at once with prompt-lookup speculation, then each alone without: every request's greedy tokens
    are the single process's plain ones (the haiku's near-tie flipped with speculation before)."""
    expected = greedy_reference(smol_int4, PROMPTS, 32)
    with local_ring(smol_int4, 2, tmp_path, [15, 15]) as local:
        batched = [tokens for tokens, _ in collect_all(local.addresses[0], PROMPTS, 32, speculate="ngram")]
        alone = [collect(local.addresses[0], p, 32, speculate="off")[0] for p in PROMPTS]
        assert batched == list(expected.values()) and alone == list(expected.values())
        rows = [status_row(a, s, i) for a, s, i in ring.status(local.addresses[0])]
        assert {r["compute_dtype"] for r in rows} == {compute_dtype("int4")}  # status shows what the nodes chose


# ------------------------------------------------------------------ bad input


def test_a_gguf_type_with_no_mapping_names_the_file(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_context_length(128)
    w.add_tensor("token_embd.weight", np.zeros((320, 64), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    for name, shape in {"attn_q": (64, 64), "attn_k": (64, 64), "attn_v": (64, 64), "attn_output": (64, 64),
                        "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}.items():
        w.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.zeros(64, dtype=np.float64))  # F64: no mapping to any store dtype
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(StoreError, match=r"odd\.gguf.*blk\.0\.attn_norm\.weight.*F64"):
        import_gguf(path, tmp_path / "out", dtype="int4")
    assert not (tmp_path / "out").exists()


def test_bad_quantized_units_name_the_file(tiny_int4, tmp_path):
    import shutil

    store_dir = tmp_path / "s"
    shutil.copytree(tiny_int4, store_dir)
    layer = store_dir / "layer_001.safetensors"
    layer.write_bytes(layer.read_bytes()[:-100])  # truncated
    windows = Windows(((0, 8),), 8, True)
    with pytest.raises(StoreError, match=r"layer_001\.safetensors: \d+ bytes, manifest says"):
        Shard(LayerStore(store_dir), windows, torch.bfloat16)
    manifest = json.loads((store_dir / "manifest.json").read_text())
    manifest["files"]["layers"][1]["bytes"] -= 100  # sizes that match the file, not its tensors
    manifest["files"]["layers"][1]["sha256"] = ""
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"layer_001\.safetensors"):
        Shard(LayerStore(store_dir), windows, torch.bfloat16)


def test_kernel_scales_are_exact_in_float32():
    d = torch.tensor([0.0123, 1e-4, 0.5]).half()
    m = torch.tensor([-0.1, -8e-4, -4.0]).half()
    sz = kernel_scales(torch.stack([d, m], -1)[None], torch.float32)[0]
    assert torch.equal(sz[:, 0], d.float()) and torch.equal(sz[:, 1], m.float() + 8 * d.float())
