"""Device/model profiles: JSON round trips, validation messages, derived sizes, presets."""

import json
import math
from pathlib import Path

import pytest

from prima_rpc.spec.manifest import read_manifest
from prima_rpc.spec.profiles import DeviceProfile, devices_from_json, devices_to_json, load_profiles
from prima_rpc.spec.shapes import PUBLISHED, layer_params, layer_shapes
from solver.model_profile import ModelProfile
from solver.presets import PRESETS, preset
from tools.synth import synth

TESTBED = Path(__file__).resolve().parents[1] / "solver" / "testbeds" / "prima_d1_d4.json"


def _dev(**kw) -> dict:
    d = {"name": "a", "os": "linux", "cpu_flops": 1e11, "gpu_flops": 0.0, "gpu_kind": "none",
         "ram_bandwidth": 4e10, "vram_bandwidth": 0.0, "disk_seq_read": 2e9, "disk_rand_read": 1e9,
         "ram_available": 2**33, "vram_free": 0, "link_latency_s": 0.005, "link_bandwidth": 5e7}
    d.update(kw)
    return d


def test_testbed_loads_with_head_first():
    devs = load_profiles(TESTBED)
    assert [d.name for d in devs] == ["D1", "D2", "D3", "D4"]
    assert devs[0].is_head and not any(d.is_head for d in devs[1:])
    assert devs[0].unified_memory and devs[2].gpu_kind == "cuda" and not devs[3].has_gpu
    assert "_source" in json.loads(TESTBED.read_text())


def test_json_round_trip():
    devs = load_profiles(TESTBED)
    assert devices_from_json(json.loads(json.dumps(devices_to_json(devs)))) == devs
    assert DeviceProfile.from_json(devs[1].to_json()) == devs[1]


@pytest.mark.parametrize("bad, msg", [
    ({"os": "beos"}, "os must be one of"),
    ({"gpu_kind": "rocm"}, "gpu_kind must be one of"),
    ({"gpu_kind": "metal", "gpu_flops": 1e12, "vram_bandwidth": 1e11}, "needs os 'macos'"),
    ({"cpu_flops": -1.0}, "cpu_flops must be a finite number >= 0"),
    ({"link_bandwidth": 0.0}, "link_bandwidth must be > 0"),
    ({"ram_available": float("nan")}, "ram_available must be a finite number"),
    ({"gpu_kind": "cuda", "gpu_flops": 1e12}, "needs vram_bandwidth > 0"),
    ({"name": ""}, "non-empty string"),
])
def test_device_validation(bad, msg):
    with pytest.raises(ValueError, match=msg):
        DeviceProfile.from_json(_dev(**bad))


def test_device_json_keys_checked():
    with pytest.raises(ValueError, match="unknown keys"):
        DeviceProfile.from_json(_dev(colour="red"))
    d = _dev()
    del d["cpu_flops"]
    with pytest.raises(ValueError, match="missing keys"):
        DeviceProfile.from_json(d)


def test_profiles_document_validation():
    with pytest.raises(ValueError, match="devices"):
        devices_from_json({"nodes": []})
    with pytest.raises(ValueError, match="empty"):
        devices_from_json({"devices": []})
    with pytest.raises(ValueError, match="duplicate"):
        devices_from_json({"devices": [_dev(), _dev()]})
    with pytest.raises(ValueError, match="first device must be the head"):
        devices_from_json({"devices": [_dev(is_head=False), _dev(name="b", is_head=True)]})
    devs = devices_from_json({"_note": "x", "devices": [_dev(), _dev(name="b")]})
    assert devs[0].is_head and not devs[1].is_head


def test_llama3_8b_shape():
    m = preset("llama3-8b")
    assert m.layer_params == 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # and two norms
    total = m.layer_params * m.n_layers + 2 * m.vocab * m.hidden
    assert 8.0e9 < total < 8.1e9
    assert m.layer_flops == 2 * (m.layer_params - 2 * 4096)  # a multiply-add per matrix weight
    assert m.kv_bytes_per_token_layer == 2 * 8 * 128 * 2
    assert m.output_flops == 2 * 4096 * 128256
    assert m.activation_bytes == 4096 * 4
    # Q4K-sized: ~4.5 bits per weight, so 8B -> ~4.5 GB on disk
    assert 4.3e9 < m.total_bytes < 4.7e9


def test_presets_have_published_dims():
    assert set(PUBLISHED) <= set(PRESETS)
    m = preset("qwen2.5-72b", bits_per_weight=32)
    assert (m.hidden, m.intermediate, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab) == \
        (8192, 29568, 80, 64, 8, 152064)
    assert m.layer_bytes[0] == m.layer_params * 4  # matrices, norms and biases, all 32-bit
    with pytest.raises(ValueError, match="unknown preset"):
        preset("gpt-5")


def test_manifest_round_trip_and_validation():
    m = preset("qwen2.5-32b")
    assert ModelProfile.from_json(m.to_manifest()) == m
    man = m.to_manifest()
    man["files"]["layers"] = man["files"]["layers"][:-1]
    with pytest.raises(ValueError, match="63 layer files for 64 layers"):
        ModelProfile.from_json(man)
    man = m.to_manifest()
    del man["dims"]["vocab"]
    with pytest.raises(ValueError, match="vocab"):
        ModelProfile.from_json(man)
    man = m.to_manifest()
    man["architecture"] = "gpt2"
    with pytest.raises(ValueError, match="architecture"):
        ModelProfile.from_json(man)


def test_tied_embeddings_use_embedding_for_output():
    m = ModelProfile.from_dims(hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab=100,
                               tie_embeddings=True, bits_per_weight=32)
    assert m.head_bytes == 64 * 4 and m.output_weight_bytes == m.embed_bytes == 100 * 64 * 4


def test_solver_and_nodes_count_a_layer_alike(tmp_path):
    """One definition of a layer's parameters (prima_rpc.spec.shapes): the profile built from a store's parsed
    manifest counts what the node's config counts, norms and q/k/v biases included."""
    for name in ("tiny", "tiny-qwen2"):
        manifest, _ = read_manifest(synth(tmp_path / name, name, manifest_only=True))
        profile = ModelProfile.from_manifest(manifest)
        assert profile.layer_params == layer_params(manifest.config) == sum(
            math.prod(s) for s in layer_shapes(manifest.config).values())
    assert preset("qwen2.5-32b").layer_params == layer_params(PRESETS["qwen2.5-32b"])
