import json

import pytest
import torch

from nodes.engine.store import LayerStore
from prima_rpc.spec.manifest import MANIFEST, StoreError, read_manifest
from prima_rpc.spec.shapes import PRESETS, layer_params
from tools.synth import synth


def test_synthetic_store_has_one_verified_file_per_unit(tiny_store):
    store = LayerStore(tiny_store)
    cfg = store.config
    assert len(store.manifest.layers) == cfg.n_layers
    layer = store.load("layer.3")
    assert layer["wq.weight"].shape == (cfg.n_heads * cfg.head_dim, cfg.hidden)
    assert store.bytes_read == store.manifest.layers[3].bytes  # only that unit's file was read


def test_synth_is_deterministic_per_seed(tmp_path):
    a = LayerStore(synth(tmp_path / "a", "tiny", seed=5)).load("layer.0")
    b = LayerStore(synth(tmp_path / "b", "tiny", seed=5)).load("layer.0")
    c = LayerStore(synth(tmp_path / "c", "tiny", seed=6)).load("layer.0")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["wq.weight"], c["wq.weight"])


def test_truncated_unit_is_reported_with_its_file(tmp_path):
    store_dir = synth(tmp_path / "s", "tiny")
    path = store_dir / "layer_002.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(StoreError, match="layer_002.safetensors.*truncated"):
        LayerStore(store_dir).load("layer.2")


def test_corrupted_unit_fails_its_checksum(tmp_path):
    store_dir = synth(tmp_path / "s", "tiny")
    path = store_dir / "layer_001.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="layer_001.safetensors: sha256 does not match"):
        LayerStore(store_dir).load("layer.1")
    LayerStore(store_dir).load("layer.0")  # other units still load


def test_manifest_only_store_plans_but_does_not_load(tmp_path):
    store_dir = synth(tmp_path / "m", "llama3-70b", manifest_only=True, bits_per_weight=4.5)
    manifest, model_id = read_manifest(store_dir)
    assert manifest.manifest_only and len(model_id) == 64
    assert sorted(p.name for p in store_dir.iterdir()) == [MANIFEST, "tokenizer.json"]
    per_layer = layer_params(PRESETS["llama3-70b"]) * 4.5 / 8
    assert manifest.layers[0].bytes == pytest.approx(per_layer, rel=1e-6)
    with pytest.raises(StoreError, match="manifest-only"):
        LayerStore(store_dir).load("layer.0")


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    from tools import synth as synth_module

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(synth_module, "random_unit", broken)  # a fault we cannot cause for real here
    with pytest.raises(OSError):
        synth(tmp_path / "s", "tiny")
    assert list(tmp_path.iterdir()) == []


def test_existing_store_is_not_overwritten_by_accident(tiny_store):
    with pytest.raises(StoreError, match="already exists"):
        synth(tiny_store, "tiny")


def test_bad_manifests_give_one_line_errors(tmp_path):
    with pytest.raises(StoreError, match="manifest.json is missing"):
        LayerStore(tmp_path)
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(StoreError, match="invalid JSON"):
        LayerStore(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "prima-store/1", "name": "x"}))
    with pytest.raises(StoreError, match="malformed manifest"):
        LayerStore(tmp_path)
