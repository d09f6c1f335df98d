"""Disk offload's reads: a unit read straight into its tensors equals a load, a streamed part reads only its
tensors in need order, bad files fail loudly, and an emulated disk keeps its rate and the bytes."""

import shutil
import time

import pytest
import torch

from nodes.engine.diskio import ChunkReader
from nodes.engine.fused import empty_layer, layer_bytes, layer_targets, unit_targets
from nodes.engine.model import Layer
from nodes.engine.store import LayerStore
from prima_rpc.spec.manifest import StoreError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reader", ["direct", "direct-small-chunks", "buffered"])
def test_read_into_equals_load(tiny_qwen_store, dtype, reader):
    store = LayerStore(tiny_qwen_store)
    if reader != "direct":  # tiny chunks: tensors straddle many chunk boundaries
        store._reader = ChunkReader(chunk=8192, in_flight=3, direct=reader != "buffered")
    for unit in ("embed", "layer.0", "layer.5", "head"):
        ref = {k: v.to(dtype) for k, v in store.load(unit).items()}
        got = store.new_tensors(unit, dtype)
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    fused = empty_layer(store.config, dtype)
    store.read_into("layer.3", layer_targets(fused, store.config))
    ref = Layer.from_unit(store.load("layer.3"), dtype)
    assert all(torch.equal(getattr(ref, f), getattr(fused, f)) for f in ("wqkv", "bqkv", "w_gate_up", "w_down"))
    assert fused.nbytes() == layer_bytes(store.config, dtype)
    assert fused.wqkv.data_ptr() % 64 == 0  # alignment decides fp32 matmul rounding: keep it like torch.cat


@pytest.mark.parametrize("reader", ["direct", "direct-small-chunks", "buffered"])
def test_read_part_reads_only_its_tensors_in_the_order_asked(tiny_qwen_store, reader):
    """A streamed unit's tensors (wq, wk, wv lie apart in the file, wo between them) in need order, each
    announced once and only when all its bytes are in, even where two ranges share a disk block."""
    store = LayerStore(tiny_qwen_store)
    if reader != "direct":
        store._reader = ChunkReader(chunk=8192, in_flight=3, direct=reader != "buffered")
    ref = store.load("layer.2")
    fused = empty_layer(store.config, torch.float32)
    targets = unit_targets("wqkv", fused.wqkv, store.config) | unit_targets("w_down", fused.w_down, store.config)
    seen = []
    n = store.read_part("layer.2", targets, lambda name: seen.append((name, torch.equal(targets[name], ref[name]))))
    assert sorted(seen) == sorted((name, True) for name in targets)  # each once, complete when announced
    assert n < store.entry("layer.2").bytes  # not the whole file
    with pytest.raises(StoreError, match="expected"):
        store.read_part("layer.2", {"nope.weight": torch.empty(1)})


def test_read_into_fails_loudly_on_bad_files(tiny_store, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_store, bad)
    store = LayerStore(bad)
    path = bad / store.entry("layer.2").path
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    target = layer_targets(empty_layer(store.config, torch.float32), store.config)
    with pytest.raises(StoreError, match="sha256"):
        store.read_into("layer.2", target)
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(StoreError, match="truncated"):
        store.read_into("layer.2", target)
    with pytest.raises(StoreError, match="expected"):
        store.read_into("layer.1", {"wq.weight": torch.empty(4)})


def test_an_emulated_disk_delivers_at_its_rate_and_the_same_bytes(tiny_store, monkeypatch):
    store = LayerStore(tiny_store)
    size = store.entry("layer.0").bytes
    target = layer_targets(empty_layer(store.config, torch.float32), store.config)
    monkeypatch.setenv("PRIMA_DISK_MBPS", str(4 * size / 1e6))  # four layer files a second
    slow = LayerStore(tiny_store)
    slow.read_into("layer.0", target)  # the emulated disk starts idle: this read takes 1/4 s
    begin = time.monotonic()
    for i in range(1, 5):
        slow.read_into(f"layer.{i}", target)
    assert time.monotonic() - begin >= 0.95  # four more files: a second at least, however fast the real disk
    assert "emulated" in slow.read_method
    ref = store.load("layer.4")
    assert all(torch.equal(ref[name], t) for name, t in target.items())  # pacing changes timing, not bytes
    for bad in ("fast", "-5", "nan", "inf"):
        monkeypatch.setenv("PRIMA_DISK_MBPS", bad)
        with pytest.raises(StoreError, match="PRIMA_DISK_MBPS"):
            LayerStore(tiny_store).read_into("layer.0", target)
