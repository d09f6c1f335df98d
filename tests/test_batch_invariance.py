"""A row's bits do not depend on what shares its call: greedy tokens are the same with speculation on or off and
alone or in a batch, for every store format (nodes/engine/quant.py linear, nodes/engine/model.py ROW_ATTENTION).

Float weights guarantee it for calls of up to FEW_ROWS rows (GEMMs of exactly PAIR columns); past that one GEMM
reads the weights once for all rows (prefill chunks, large batches) and a row's low bits may differ. The quantized
kernels compute each row alone, so they guarantee it at any row count."""

import pytest
import torch

from nodes.engine.quant import FEW_ROWS, Int4, Int8, linear, machine_layout, pack_int4, quantize_int4, quantize_int8
from nodes.engine.row_attention import ROW_ATTENTION
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.windows import Windows
from tools.synth import synth


def weights(kind: str, w: torch.Tensor):
    """(weight, activation dtype) of a float [N, K] matrix in `kind`."""
    if kind == "int4":
        q, dm = quantize_int4(w)
        return Int4.from_dm(pack_int4(q, machine_layout()), dm, torch.bfloat16, machine_layout()), torch.bfloat16
    if kind.startswith("int8"):
        q, scale = quantize_int8(w)
        weight = Int8(q, scale, torch.bfloat16)
        weight.onednn = kind == "int8-onednn"  # both paths, whatever size this machine sends through which
        return weight, torch.bfloat16
    dtype = getattr(torch, kind)
    return w.to(dtype), dtype


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "int8", "int8-onednn", "int4"])
@pytest.mark.parametrize("shape", [(576, 1536), (1728, 576)])  # SmolLM2's w_down, wqkv
def test_linear_gives_a_row_the_same_bits_in_any_call(kind, shape):
    from nodes.engine.quant import onednn_int8_exact

    if kind == "int8-onednn" and not onednn_int8_exact():
        pytest.skip("oneDNN's int8 sums saturate here (no VNNI): int8 never takes that path on this machine")
    w, dtype = weights(kind, torch.randn(*shape) * 0.05)
    x = torch.randn(40, shape[1]).to(dtype)
    alone = torch.cat([linear(row, w) for row in x.split(1)])
    most = FEW_ROWS if dtype.is_floating_point and isinstance(w, torch.Tensor) else 40
    for rows in range(2, most + 1):
        assert torch.equal(linear(x[:rows], w), alone[:rows]), rows


STORES = ["float32", "bfloat16", "float16", "int8", "int4"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    return {kind: synth(root / kind, "tiny", seed=5, dtype=kind) for kind in STORES}


def shard_of(store, dtype) -> Shard:
    cfg = LayerStore(store).config
    return Shard(LayerStore(store), Windows(((0, cfg.n_layers),), cfg.n_layers, True), dtype, budget=0)


@pytest.mark.parametrize("kind", STORES + ["float32-bfloat16", "int4-float32"])  # int4-float32: q4.c where it builds
def test_a_verify_frame_and_a_batch_give_each_row_its_steps_bits(kind, stores, monkeypatch):
    """Three requests after their prompts: A's next 5 tokens as one verify frame beside B's and C's decode tokens
    in one batch give A's rows the bits of 5 one-token steps and B's and C's those of their steps alone; on the
    quantized stores also in a batch of more than FEW_ROWS rows (a second verify frame)."""
    store_kind, _, dtype_name = kind.partition("-")
    if store_kind == "int8":
        monkeypatch.setattr("nodes.engine.quant.ONEDNN_MIN_WEIGHTS", 0)  # oneDNN where its sums are exact
    ref = ReferenceModel(stores[store_kind], getattr(torch, dtype_name) if dtype_name else None)
    shard = shard_of(stores[store_kind], ref.dtype)
    prompts = {r: ref.codec.encode(p) for r, p in zip("ABCD", ["the cat sat", "a b c d e", "hello there", "x y z"])}
    drafts = {"A": [5, 9, 11, 3, 7], "B": [4], "C": [8], "D": [6, 2, 10, 12, 1, 13]}
    quantized = store_kind in ("int8", "int4")
    who = "ABCD" if quantized else "ABC"
    assert sum(len(drafts[r]) for r in who) > FEW_ROWS or not quantized
    assert max(len(d) for d in drafts.values()) <= ROW_ATTENTION
    try:
        def prefill(tag: str) -> dict:
            caches = {}
            for r in who:
                ids = prompts[r]
                caches[r] = shard.cache_for(f"{tag}{r}", 0, len(ids) + 8, len(ids))
                shard.compute(shard.embed(ids), caches[r], 0, 0)
            return caches

        steps = prefill("steps-")
        alone = {r: torch.cat([shard.compute(shard.embed([t]), steps[r], len(prompts[r]) + i, 0)[0]
                               for i, t in enumerate(drafts[r])]) for r in who}
        batch = prefill("batch-")
        items = [(shard.embed(drafts[r]), batch[r], len(prompts[r])) for r in who]
        together, _ = shard.compute_batch(items, 0)
        for r, rows in zip(who, together):
            assert torch.equal(rows, alone[r]), r
            assert torch.equal(shard.logits(rows), shard.logits(alone[r]))
    finally:
        shard.close()
