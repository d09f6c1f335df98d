"""A shard's and the reference's decode steps take a run of resident layers as one C call (window_calls) and give
the bits of the layer-by-layer path, hidden states and caches, in a batch of requests; the runs are cut where
layers stream."""

from types import SimpleNamespace

import pytest
import torch

from nodes.engine import window_calls
from nodes.engine.kernels import ops, q4
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.windows import Windows
from tools.synth import synth

pytestmark = pytest.mark.skipif(not (ops.available() and q4.available()), reason="ops.c and q4.c build on x86 with "
                                "AVX2 and up and on aarch64 only")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("window") / "int4", "tiny", seed=6, dtype="int4")


def decode(shard: Shard, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list]:
    """Each prompt's prefill alone, then `steps` decode steps of all of them as one batch: the last hidden states
    and the caches."""
    caches = [shard.cache_for(f"r{n}", 0, 32, len(p)) for n, p in enumerate(prompts)]
    hs = [shard.compute(shard.embed(p), c, 0, 0)[0] for p, c in zip(prompts, caches, strict=True)]
    for step in range(steps):
        items = [(shard.embed([int(h[-1].abs().argmax()) % shard.cfg.vocab]), c, len(p) + step)
                 for h, c, p in zip(hs, caches, prompts, strict=True)]
        hs, _ = shard.compute_batch(items, 0)
    return hs, caches


def test_a_shards_decode_steps_give_the_layer_by_layer_bits(store, monkeypatch):
    cfg = LayerStore(store).config
    windows = Windows(((0, cfg.n_layers),), cfg.n_layers, True)
    prompts = [[1, 5, 9], [2, 4], [7, 3, 8, 6]]
    taken = []
    real = window_calls.forward
    monkeypatch.setattr(window_calls, "forward", lambda *args: taken.append(real(*args)) or taken[-1])
    ours, ours_caches = decode(Shard(LayerStore(store), windows, torch.float32), prompts, 4)
    assert sum(y is not None for y in taken) == 3 + 4  # each (short) prefill and decode step: one call, all layers
    monkeypatch.setattr(window_calls, "forward", lambda *args: None)
    theirs, theirs_caches = decode(Shard(LayerStore(store), windows, torch.float32), prompts, 4)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for a, b, p in zip(ours_caches, theirs_caches, prompts, strict=True):  # the positions written (empty past)
        assert all(torch.equal(a.kv[i][:, :, :len(p) + 4], b.kv[i][:, :, :len(p) + 4]) for i in a.kv)


def test_the_reference_takes_the_window_call_too(store, monkeypatch):
    ref = ReferenceModel(store, torch.float32)
    ids = [3, 1, 4, 1, 5]
    cache = ref.new_cache(16)
    ref.step(ids, 0, cache)
    ours = ref.step([9], len(ids), cache)
    assert ref.layers[0].runs[ref.cfg.n_layers].args is not None
    monkeypatch.setattr(window_calls, "forward", lambda *args: None)
    cache = ref.new_cache(16)
    ref.step(ids, 0, cache)
    assert torch.equal(ours, ref.step([9], len(ids), cache))


@pytest.mark.parametrize("resident, start, stop, runs", [
    ({0, 1, 2, 3}, 0, 4, [(0, 4)]),
    ({0, 1, 3, 4}, 0, 5, [(0, 2), (2, 3), (3, 5)]),
    ({2}, 0, 4, [(0, 2), (2, 3), (3, 4)]),
    (set(), 2, 5, [(2, 5)]),
    ({5, 6}, 4, 7, [(4, 5), (5, 7)]),
])
def test_a_window_is_cut_into_resident_and_streamed_runs(resident, start, stop, runs):
    shard = SimpleNamespace(layers=dict.fromkeys(resident), _runs={})
    assert Shard._resident_runs(shard, start, stop) == runs
