"""Mixtures of experts as users get them: tiny seeded Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral models written
by transformers, imported from the Hugging Face directory and from a GGUF written by llama.cpp's converter, give
transformers' greedy tokens and logits; each expert is a unit of its own in float and quantized stores."""

from dataclasses import replace

import pytest
import torch

from nodes.engine.formats import weight_format
from nodes.engine.kernels.q4 import Q4Rows
from nodes.engine.loading import read_layer
from nodes.engine.quant import Int4, Int8
from nodes.engine.store import LayerStore
from prima_rpc.spec.manifest import StoreError, expert_unit, read_manifest
from prima_rpc.spec.shapes import expert_shapes
from tests.arch_models import MOE_FAMILIES, check, model_maker
from tests.llama_convert import convert
from tools.import_gguf import import_gguf
from tools.import_hf import import_hf

FAMILIES = list(MOE_FAMILIES)


@pytest.fixture(scope="module")
def models(smol_store, tmp_path_factory):
    return model_maker(smol_store / "tokenizer.json", tmp_path_factory)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_import_equals_transformers(models, family, tmp_path):
    hf, ids, logits = models(family)
    store = import_hf(hf, tmp_path / "store")
    check(store, ids, logits)
    cfg = read_manifest(store)[0].config
    assert (cfg.architecture, cfg.n_experts, cfg.n_experts_used) == (family, 8, 2)
    assert cfg.norm_topk_prob == (family != "qwen2moe") and bool(cfg.shared_intermediate) == (family == "qwen2moe")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_import_equals_transformers(models, family, tmp_path):
    hf, ids, logits = models(family)
    store = import_gguf(convert(hf, tmp_path / f"{family}.gguf"), tmp_path / "store")
    check(store, ids, logits)
    # the same model as the HF import sees (the router's renormalisation is llama.cpp's choice per family; eps
    # arrives as float32)
    got, want = (read_manifest(s)[0].config for s in (store, import_hf(hf, tmp_path / "hf-store")))
    assert replace(got, norm_eps=want.norm_eps) == want


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_each_expert_is_a_unit_of_its_own(models, dtype, tmp_path):
    hf = models("qwen2moe")[0]
    store = LayerStore(import_hf(hf, tmp_path / "store", dtype=dtype))
    m, cfg = store.manifest, store.config
    assert [len(layer) for layer in m.experts] == [cfg.n_experts] * cfg.n_layers
    units = m.units()
    assert all(units[expert_unit(i, e)] == m.experts[i][e] for i in range(cfg.n_layers) for e in range(cfg.n_experts))
    assert len({f.path for f in units.values()}) == len(units)  # a file each
    dense = store.load("layer.1")
    assert dense["router.weight"].dtype == torch.float32 and dense["shared_gate.weight"].shape == (1, cfg.hidden)
    assert not any(n.startswith(("w_gate", "w_up", "w_down")) for n in dense)  # the experts are not in the layer
    one = store.load(expert_unit(1, 5))
    if dtype == "float32":
        assert {n: tuple(t.shape) for n, t in one.items()} == expert_shapes(cfg)
    else:  # quantized as dense matrices are, fused as the maths multiplies by them
        assert set(one) == {"w_gate_up.qweight", "w_gate_up.scales", "w_down.qweight", "w_down.scales"}
        layer = read_layer(store, 1, cfg, torch.bfloat16, weight_format(m), experts=[5])
        assert list(layer.moe.experts) == [5]
        assert isinstance(layer.moe.experts[5].w_gate_up, (Int4, Q4Rows) if dtype == "int4" else Int8)


def test_a_dense_layer_count_of_experts_is_refused(models, tmp_path):
    import json
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(models("qwen3moe")[0], hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [1]}))
    with pytest.raises(StoreError, match="dense layers among the sparse ones"):
        import_hf(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
