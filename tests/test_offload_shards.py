"""Disk offload in process: shards under budgets down to one layer (streamed, partly resident, with odd
buffers, interleaved requests) equal the reference bit for bit; KV caches stay within the budget."""

import shutil

import pytest
import torch

from nodes.engine.fused import head_bytes, kv_bytes, layer_bytes
from nodes.engine.model import KVCache, window_slots
from nodes.engine.prefetch import KV_RESERVE_TOKENS
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.windows import Step, Windows
from tests.shards import check_against_reference, ring_step
from tools.synth import synth


@pytest.mark.parametrize("ranges, budget, depth", [
    ([[(0, 8)]], 1, 2),                        # one node, a budget of one layer
    ([[(0, 8)]], 1, 0),                        # ... loading on demand
    ([[(0, 8)]], 1_300_000 + 3 * 148_000, 2),  # a few layers of room
    ([[(4, 6)], [(0, 2)], [(2, 4), (6, 8)]], 1, 2),  # 3 nodes, k = 2, one-layer budgets
    ([[(2, 4), (6, 8)], [(0, 2), (4, 6)]], 1, 1),
], ids=["1node-1layer", "1node-1layer-nopf", "1node-3layers", "3nodes-k2", "2nodes-k2"])
def test_streamed_shards_equal_the_reference(tiny_store, ranges, budget, depth):
    shards = check_against_reference(tiny_store, ranges, budget, depth, steps=6)
    for s in shards:
        assert s.plan.streamed and s.prefetcher.loads >= 6 and s.prefetcher.misses == 0
        assert s.stall_s >= 0 and s.compute_s > 0
        assert s.resident_bytes() <= s.plan.budget


@pytest.mark.parametrize("buffer_layers", [1.0, 1.3, 2.6])
def test_partly_resident_layers_and_odd_buffers_equal_the_reference(tiny_store, buffer_layers):
    """A budget of 3.4 layers beside the buffer: one streamed layer keeps some matrices resident."""
    cfg = LayerStore(tiny_store).config
    layer = layer_bytes(cfg, torch.float32)
    fixed = head_bytes(cfg, torch.float32) + kv_bytes(cfg, torch.float32, 8, min(KV_RESERVE_TOKENS, cfg.max_seq_len))
    buffer = int(buffer_layers * layer)
    (shard,) = check_against_reference(tiny_store, [[(0, 8)]], fixed + int(3.4 * layer) + buffer, 1, steps=6,
                                       buffer=buffer)
    assert any(len(units) < 4 for _, units in shard.plan.streamed) and shard.kept
    assert shard.prefetcher.misses == 0 and shard.resident_bytes() <= shard.plan.budget


def test_a_verified_store_reads_only_what_stays_when_streaming(tiny_store):
    """A second assignment on the same store reads streamed layers' kept parts only (their checksums
    passed with the first), and still equals the reference."""
    store = LayerStore(tiny_store)
    cfg = store.config
    layer = layer_bytes(cfg, torch.float32)
    fixed = head_bytes(cfg, torch.float32) + kv_bytes(cfg, torch.float32, 8, min(KV_RESERVE_TOKENS, cfg.max_seq_len))
    budget = fixed + int(3.4 * layer) + layer
    Shard(store, Windows(((0, 8),), 8, True), torch.float32, budget=budget, depth=1, buffer=layer).close()
    before = store.bytes_read
    shard = Shard(store, Windows(((0, 8),), 8, True), torch.float32, budget=budget, depth=1, buffer=layer)
    try:
        whole = sum(store.entry(u).bytes for u in ["embed", "head"] + [f"layer.{i}" for i in range(8)])
        assert store.bytes_read - before < whole - 3 * layer  # streamed layers were not read whole
        assert shard.kept and any(len(us) < 4 for _, us in shard.plan.streamed)
        ref = ReferenceModel(tiny_store)
        ids = ref.codec.prompt_ids("The quick brown fox")
        cache, ref_cache = shard.cache_for("r", 0, len(ids) + 3, len(ids)), ref.new_cache(len(ids) + 3)
        pos = 0
        for _ in range(3):
            expected = ref.step(ids, pos, ref_cache)
            assert torch.equal(ring_step([shard], [cache], ids, pos), expected)
            pos, ids = pos + len(ids), [int(expected.argmax())]
    finally:
        shard.close()


def test_fitting_layers_stay_resident(tiny_store):
    (shard,) = check_against_reference(tiny_store, [[(0, 8)]], 0, 2, steps=3)
    assert shard.prefetcher is None and not shard.plan.streamed and len(shard.layers) == 8
    assert shard.store.bytes_read == sum(shard.store.entry(u).bytes for u in
                                         ["embed", "head"] + [f"layer.{i}" for i in range(8)])


def test_windowed_layers_count_their_ring_not_the_capacity(tmp_path):
    """Sliding-window layers hold window + ROW_ATTENTION positions (KVCache): the KV reserve, the room check and
    its message count those, so a request at the whole context fits a budget whose reserve is one such request."""
    store = synth(tmp_path / "gemma3", "tiny-gemma3", seed=3)  # 6 layers, 5 with a window of 8, 512 positions
    shard = Shard(LayerStore(store), Windows(((0, 6),), 6, True), torch.float32, budget=1, depth=1)
    cfg, ring = shard.cfg, window_slots(shard.cfg)
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    for capacity in (1, ring, ring + 1, 512):
        assert kv_bytes(cfg, torch.float32, range(6), capacity) == KVCache(list(range(6)), cfg, capacity,
                                                                           torch.float32).nbytes()
    assert shard.kv_room == per_position * (5 * ring + 512)  # a reserve of one request at the whole context
    assert shard.kv_positions() == 512  # what the head admits: that request, not the room over 6 layers' bytes
    shard.cache_for("long", 0, 512, 4)  # counted whole, 6 layers x 512 positions, it would not fit
    shard.release("long")
    shard.cache_for("a", 0, 400, 4)
    free = 5 * ring + 512 - (5 * ring + 400)  # positions' worth of bytes left: 112, 6 layers a position below the ring
    with pytest.raises(ValueError, match=rf"room for {free // 6} more KV positions.*needs 100"):
        shard.cache_for("b", 0, 100, 4)
    shard.cache_for("b", 0, free // 6, 4)
    assert shard.resident_bytes() <= shard.plan.budget
    shard.close()


def test_kv_caches_stay_within_the_budget(tiny_store):
    """The budget keeps room for KV_RESERVE_TOKENS positions; caches beyond what it leaves are refused with
    a message that says what to do, and room comes back when a request ends."""
    shard = Shard(LayerStore(tiny_store), Windows(((0, 8),), 8, True), torch.float32, budget=1, depth=1)
    reserve = min(KV_RESERVE_TOKENS, shard.cfg.max_seq_len)
    assert shard.kv_room == kv_bytes(shard.cfg, torch.float32, 8, reserve)
    shard.cache_for("a", 0, reserve // 2, 4)
    shard.cache_for("b", 0, reserve // 2, 4)  # together exactly the reserve
    with pytest.raises(ValueError, match=r"room for 0 more KV positions.*needs 8.*--mem-budget"):
        shard.cache_for("c", 0, 8, 4)
    shard.release("a")
    shard.cache_for("c", 0, 8, 4)
    assert shard.resident_bytes() <= shard.plan.budget
    unlimited = Shard(LayerStore(tiny_store), Windows(((0, 8),), 8, True), torch.float32, budget=0)
    unlimited.cache_for("long", 0, unlimited.cfg.max_seq_len, 4)  # no budget: no limit
    shard.close()


def test_interleaved_requests_stay_exact(tiny_store):
    """Two requests' frames alternate through streamed shards (k = 2): mispredictions, still exact."""
    ref = ReferenceModel(tiny_store)
    shards = [Shard(LayerStore(tiny_store), Windows(r, 8, i == 0), torch.float32, budget=970_000, depth=1)
              for i, r in enumerate((((2, 4), (6, 8)), ((0, 2), (4, 6))))]
    try:
        reqs = []
        for rid, prompt in (("a", "Hello"), ("b", "A longer prompt here")):
            ids = ref.codec.prompt_ids(prompt)
            reqs.append(dict(ids=ids, pos=0, x=None, next=0, ref=ref.new_cache(len(ids) + 5),
                             caches=[s.cache_for(rid, 0, len(ids) + 5, len(ids)) for s in shards], tokens=0))
        while any(r["tokens"] < 5 for r in reqs):
            for r in reqs:  # one frame of each request in turn
                if r["tokens"] == 5:
                    continue
                if r["x"] is None:
                    r["x"] = shards[0].embed(r["ids"])
                i = next(i for i, s in enumerate(shards) if s.windows.step(r["next"]) is Step.COMPUTE)
                r["x"], r["next"] = shards[i].compute(r["x"], r["caches"][i], r["pos"], r["next"])
                if r["next"] == 8:
                    expected = ref.step(r["ids"], r["pos"], r["ref"])
                    assert torch.equal(shards[0].logits(r["x"]), expected)
                    r.update(ids=[int(expected.argmax())], pos=r["pos"] + len(r["ids"]), x=None, next=0,
                             tokens=r["tokens"] + 1)
        assert sum(s.prefetcher.misses for s in shards) > 0
    finally:
        for s in shards:
            s.close()


def test_a_streamed_layer_that_goes_bad_fails_the_request(tiny_store, tmp_path):
    store_dir = tmp_path / "store"
    shutil.copytree(tiny_store, store_dir)
    shard = Shard(LayerStore(store_dir), Windows(((0, 8),), 8, True), torch.float32, budget=1, depth=1)
    try:
        path = store_dir / shard.store.entry("layer.5").path
        path.write_bytes(path.read_bytes()[:-64])
        cache = shard.cache_for("r", 0, 4, 1)
        with pytest.raises(ValueError, match="layer 5 could not be read"):
            for _ in range(2):  # the reader may have prefetched layer 5 before the damage
                ring_step([shard], [cache], [5], 0)
    finally:
        shard.close()


# ------------------------------------------------------------------ SmolLM2 and real processes


@pytest.mark.slow
def test_smollm2_with_a_one_layer_budget_equals_the_reference(smol_store):
    check_against_reference(smol_store, [[(20, 30)], [(0, 20)]], 1, 2, steps=4, prompt="What is 2+2?")
