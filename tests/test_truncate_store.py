"""A draft store of a store's first N layers (tools/truncate_store.py) keeps what is per layer for those N: an int4
store's int8 matrices of each layer, a Gemma 3's windowed layers; it loads and equals the source on those layers."""

import json

import pytest
import torch

from nodes.engine.formats import weight_format
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.manifest import read_manifest
from tests.test_quant_gguf_types import Q4_K_M, mixed_gguf
from tools.import_gguf import import_gguf
from tools.synth import synth
from tools.truncate_store import truncate_store


@pytest.mark.slow  # imports a 4-layer file with SmolLM2's vocabulary
def test_a_mixed_int4_store_keeps_its_first_layers_formats(tmp_path):
    store = import_gguf(mixed_gguf(tmp_path / "q4km.gguf", Q4_K_M), tmp_path / "store")
    draft = tmp_path / "draft"
    truncate_store(store, draft, 2)
    assert json.loads((draft / "manifest.json").read_text())["quant"]["int8_layers"] == [[], ["wv", "w_down"]]
    fmt = weight_format(LayerStore(draft).manifest)
    assert fmt.layer(1).matrix("wv").name == "int8" and fmt.layer(0).matrix("wv").name == "int4"
    full, first = ReferenceModel(store), ReferenceModel(draft)
    ids = first.codec.prompt_ids("The quick brown fox")
    a = full.hidden(ids, 0, full.new_cache(len(ids)), 0, 2)
    assert torch.equal(first.hidden(ids, 0, first.new_cache(len(ids))), a)


def test_a_gemma3_store_keeps_its_first_windowed_layers(tmp_path):
    store = synth(tmp_path / "gemma3", "tiny-gemma3", seed=3)  # layers 0-4 windowed, 5 global
    truncate_store(store, tmp_path / "draft", 3)
    cfg = read_manifest(tmp_path / "draft")[0].config
    assert (cfg.n_layers, cfg.local_layers) == (3, (0, 1, 2))
