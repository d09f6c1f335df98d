"""Disk offload: the memory plan and the prefetcher's decisions (tables), direct reads, and generation equal
to the reference under budgets down to one layer, in process and on a real ring, with peak RSS in budget."""

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from nodes.engine.diskio import ChunkReader
from nodes.engine.fused import empty_layer, head_bytes, kv_bytes, layer_bytes, layer_targets, unit_targets
from nodes.engine.model import STAGES, Layer
from nodes.engine.prefetch import (
    KV_RESERVE_TOKENS,
    Prefetcher,
    aligned,
    arena_alloc,
    fits_alone,
    placement,
    plan_memory,
    share,
    spread_counts,
)
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.shapes import matrix_shapes
from prima_rpc.spec.windows import Step, Windows

MB = 1 << 20


# ------------------------------------------------------------------ decisions

UNITS = {"wqkv": MB // 8, "wo": MB // 8, "w_gate_up": MB // 2, "w_down": MB // 4}  # a 1 MB layer's matrices


@pytest.mark.parametrize("total, weights, expected", [
    (0, [4, 4], [0, 0]), (3, [4, 4], [2, 1]), (6, [2, 4, 2], [2, 3, 1]), (2, [1, 7], [0, 2]), (8, [4, 4], [4, 4]),
])
def test_share(total, weights, expected):
    assert share(total, weights) == expected and sum(share(total, weights)) == total


@pytest.mark.parametrize("total, lengths, lead, expected", [
    (7, [5, 5], 2, [4, 3]), (6, [5, 5], 2, [3, 3]), (3, [5, 5], 2, [2, 1]),
    (9, [10, 2, 4], 2, [4, 2, 3]),  # the short window is full: the rest go to the others, alike
])
def test_every_round_reads_alike(total, lengths, lead, expected):
    assert spread_counts(total, lengths, lead) == expected


@pytest.mark.parametrize("count, lead, expected", [
    (0, 2, []), (1, 2, [0]), (3, 2, [0, 1, 7]), (5, 1, [0, 4, 5, 6, 7]), (8, 2, list(range(8))),
])
def test_streamed_layers_lead_a_window_and_close_it(count, lead, expected):
    assert placement(list(range(8)), count, lead) == expected


@pytest.mark.parametrize("budget, prefetch, buffer, streamed_bytes, buffer_bytes, effective", [
    (0, True, 0, 0, 0, 0),                                 # unlimited: all resident
    (15 * MB, True, 0, 0, 0, 15 * MB),                     # all fits
    (1, True, 0, 10 * MB, 2 * MB, 7 * MB),                 # below head + KV + buffer: runs at that minimum
    (11 * MB, True, 0, 6 * MB, 2 * MB, 11 * MB),           # 4 MB for resident layers beside a 2-layer buffer
    (11 * MB, False, 0, 5 * MB, MB, 11 * MB),              # no prefetch: a one-layer buffer, one more resident
    (11 * MB + MB // 4, True, 0, 6 * MB - MB // 4, 2 * MB, 11 * MB + MB // 4),  # a quarter layer more: w_down
    (11 * MB, True, MB + MB // 2, 5 * MB + MB // 2, MB + MB // 2, 11 * MB),  # the plan's buffer
    (11 * MB, True, MB // 2, 5 * MB, MB, 11 * MB),         # ... at least one layer
])
def test_plan_memory(budget, prefetch, buffer, streamed_bytes, buffer_bytes, effective):
    order = list(range(10, 20))
    plan = plan_memory(order, UNITS, 0, 5 * MB, budget, prefetch, buffer)  # head + KV reserve 5 MB
    assert (plan.streamed_bytes, plan.buffer, plan.prefetch, plan.budget) == (
        streamed_bytes, buffer_bytes, prefetch, effective)
    layers = [layer for layer, _ in plan.streamed]
    assert layers == sorted(layers) and set(layers) | plan.resident == set(order)  # visit order
    assert sum(len(us) < 4 for _, us in plan.streamed) <= 1  # at most one layer keeps some matrices
    if plan.streamed:
        assert plan.fixed_bytes + plan.weight_bytes <= plan.budget
        assert plan.below_minimum == (budget < effective)


def test_streamed_layers_lead_and_close_each_window():
    plan = plan_memory([0, 1, 2, 3, 10, 11, 12, 13], UNITS, 0, 0, 6 * MB, True, MB)  # 1 MB buffer, 5 resident
    assert [layer for layer, _ in plan.streamed] == [0, 3, 10]  # windows of 4: 2 (first, last) and 1 (first)


@pytest.mark.parametrize("used, n, expected", [
    ([], 4, 0), ([], 11, None),
    ([(0, 4)], 4, 4), ([(0, 4), (4, 4)], 3, None), ([(0, 4), (4, 4)], 2, 8),
    ([(4, 4), (8, 2)], 4, 0), ([(4, 4), (8, 2)], 5, None),  # wraps to the start when the end is too short
    ([(6, 4), (0, 3)], 3, 3), ([(6, 4), (0, 3)], 4, None),  # wrapped: only up to the oldest
])
def test_arena_alloc(used, n, expected):
    assert arena_alloc(10, used, n) == expected


@pytest.mark.parametrize("offset, sizes, expected", [
    (0, [10], True), (0, [11], False), (7, [2, 3], True),   # [7, 9), then [0, 3): wraps once, below 7
    (7, [2, 6], True), (7, [2, 8], False),                # the second unit would run into the first
    (7, [4], False), (5, [2, 2, 5], True), (5, [2, 2, 6], False),
])
def test_a_layer_starts_only_where_it_can_finish(offset, sizes, expected):
    """Its units must fit once everything older is freed, or the compute thread would wait for ever."""
    assert fits_alone(10, offset, sizes) == expected


UNIT_OF = {"wq.weight": "wqkv", "wk.weight": "wqkv", "wv.weight": "wqkv", "wo.weight": "wo",
           "w_gate.weight": "w_gate_up", "w_up.weight": "w_gate_up", "w_down.weight": "w_down"}


class FakeStore:
    """read_part records one read per unit (layer number) and sleeps per unit: enough to drive a Prefetcher
    without a disk."""

    def __init__(self, cfg, delay: float):
        self.config, self.delay, self.reads = cfg, delay, []

    def read_part(self, unit: str, targets: dict, done=lambda name: None) -> int:
        layer, last = int(unit.split(".")[1]), None
        for name, t in targets.items():
            if UNIT_OF[name] != last:
                time.sleep(self.delay)
                self.reads.append(layer)
                last = UNIT_OF[name]
            t.fill_(float(layer))
            done(name)
        return 0


def streaming_plan(cfg, budget_layers: float, prefetch: bool = True, buffer_layers: float = 0):
    units = {u: aligned(torch.Size(s).numel() * 4) for u, s in matrix_shapes(cfg).items()}
    layer = sum(units.values())
    return plan_memory(list(range(8)), units, 0, 0, int(budget_layers * layer), prefetch, int(buffer_layers * layer))


def use(p: Prefetcher, layer: int) -> None:
    """Compute one layer stage by stage, as a shard does: each stage takes and frees its own matrices."""
    for stage in STAGES:
        streamed = tuple(u for u in stage if u in p.units[layer])
        if streamed:
            got = p.acquire(layer, streamed)
            assert all(t.flatten()[0].item() == layer and t.flatten()[-1].item() == layer for t in got.values())
            time.sleep(0.001)  # compute
            p.release(layer, streamed)


@pytest.mark.parametrize("prefetch, buffer_layers", [(False, 0), (True, 1), (True, 1.3), (True, 1.7), (True, 2),
                                                     (True, 2.5)])
def test_prefetcher_reads_each_unit_once_per_use_in_order(tiny_store, prefetch, buffer_layers):
    cfg = LayerStore(tiny_store).config
    plan = streaming_plan(cfg, 2 + max(buffer_layers, 1), prefetch, buffer_layers)  # 2 resident, 6 streamed
    assert len(plan.streamed) >= 6  # (a seventh keeps part of its matrices when rounding leaves room)
    store = FakeStore(cfg, 0.002)
    p = Prefetcher(store, plan, cfg, torch.float32)
    p.start()
    try:
        uses = []
        for _ in range(3):  # three tokens
            for layer, units in plan.streamed:
                use(p, layer)
                uses += [layer] * len(units)
        time.sleep(0.05)
        # every read was used, in order; at most what the buffer holds is pending beyond the last use
        assert store.reads[:len(uses)] == uses
        assert len(store.reads) - len(uses) <= plan.buffer // min(plan.unit_bytes.values())  # what the buffer holds
        assert p.misses == 0
    finally:
        p.close()


def test_prefetcher_reaims_after_a_misprediction(tiny_store):
    cfg = LayerStore(tiny_store).config
    plan = streaming_plan(cfg, 3, buffer_layers=3)  # a 3-layer buffer, all 8 streamed
    store = FakeStore(cfg, 0.001)
    p = Prefetcher(store, plan, cfg, torch.float32)
    p.start()
    try:
        for layer in (0, 1, 5, 6, 0, 1, 2):
            use(p, layer)
        assert p.misses == 2  # 5 (2 was expected), 0 (7 was expected)
    finally:
        p.close()
    assert not p.thread.is_alive()


# ------------------------------------------------------------------ reads


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


# ------------------------------------------------------------------ shards against the reference


def ring_step(shards: list[Shard], caches: list, ids: list[int], pos: int) -> torch.Tensor:
    """One step through in-process shards in ring order (shards[0] is the head): logits of the last id."""
    x, next_layer, n = shards[0].embed(ids), 0, shards[0].cfg.n_layers
    while next_layer < n:
        i = next(i for i, s in enumerate(shards) if s.windows.step(next_layer) is Step.COMPUTE)
        x, next_layer = shards[i].compute(x, caches[i], pos, next_layer)
    return shards[0].logits(x)


def check_against_reference(store_dir: Path, ranges: list, budget: int, depth: int, steps: int,
                            prompt: str = "The quick brown fox", buffer: int = 0) -> list[Shard]:
    ref = ReferenceModel(store_dir)
    n = ref.cfg.n_layers
    shards = [Shard(LayerStore(store_dir), Windows(tuple(r), n, i == 0), torch.float32, budget=budget, depth=depth,
                    buffer=buffer) for i, r in enumerate(ranges)]
    try:
        ids = ref.codec.prompt_ids(prompt)
        capacity = len(ids) + steps
        ref_cache = ref.new_cache(capacity)
        caches = [s.cache_for("r", 0, capacity, len(ids)) for s in shards]
        pos = 0
        for _ in range(steps):
            expected = ref.step(ids, pos, ref_cache)
            got = ring_step(shards, caches, ids, pos)
            assert torch.equal(got, expected)  # bit for bit: same weights, same alignment, same math
            pos, ids = pos + len(ids), [int(expected.argmax())]
    finally:
        for s in shards:
            s.close()
    return shards


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


RSS_SCRIPT = r"""
import json, sys, threading, time
import psutil, torch
from prima_rpc.spec.windows import Windows
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore

store_dir, budget, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
proc = psutil.Process()
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's lazy start-up belongs to the baseline
baseline = proc.memory_info().rss
peak, done = baseline, threading.Event()

def sample():
    global peak
    while not done.is_set():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.002)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
store = LayerStore(store_dir)
n = store.config.n_layers
shard = Shard(store, Windows(((0, n),), n, True), torch.float32, budget=budget)
ids, pos = [1, 2, 3, 4, 5, 6, 7, 8], 0
cache = shard.cache_for("r", 0, len(ids) + steps, len(ids))
for _ in range(steps):
    h, _ = shard.compute(shard.embed(ids), cache, pos, 0)
    pos, ids = pos + len(ids), [int(shard.logits(h).argmax())]
done.set()
sampler.join()
print(json.dumps({"baseline": baseline, "peak": peak, "end": proc.memory_info().rss, "budget": shard.plan.budget,
                  "streamed": len(shard.plan.streamed), "share": n * shard.plan.layer_bytes,
                  "resident_bytes": shard.resident_bytes(), "staging": store.staging_bytes}))
"""
RSS_OVERHEAD = 32 * MB  # read staging (16 MiB), rope tables, activations, allocator slack
NODE_OVERHEAD = 48 * MB  # the same, plus what a node's first request adds (gRPC buffers, torch's thread pools)
TOKENIZER_OVERHEAD = 48 * MB  # the head also holds the tokenizer (about 33 MiB for SmolLM2's)


@pytest.mark.slow
def test_peak_rss_stays_within_budget(smol_store):
    cfg = LayerStore(smol_store).config
    budget = head_bytes(cfg, torch.float32) + 40 * MB + 6 * layer_bytes(cfg, torch.float32)
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(smol_store), str(budget), "6"],
                         capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["budget"] == budget and r["streamed"] > 20  # most of the 30 layers stream
    growth = r["peak"] - r["baseline"]
    assert growth <= budget + RSS_OVERHEAD, f"peak RSS grew {growth / MB:.0f} MiB for a {budget / MB:.0f} MiB budget"
    assert r["resident_bytes"] <= budget


@pytest.mark.slow
def test_ring_under_one_layer_budgets_equals_the_reference(smol_store, tmp_path):
    from prima_rpc.app import ring
    from prima_rpc.app.local_ring import launch
    from prima_rpc.client import PrimaClient, PrimaError, Token

    prompts, tokens = ["What is the capital of France?", "List three prime numbers."], 8
    model = ReferenceModel(smol_store)
    reference = {p: [t.token_id for t in model.generate(p, GenerateParams(max_tokens=tokens))] for p in prompts}
    del model
    local = launch(smol_store, 3, log_dir=tmp_path, detach=False, extra_args=[["--mem-budget", "1"]] * 3)
    try:
        procs = [psutil.Process(p.pid) for p in local.processes]
        idle = [p.memory_info().rss for p in procs]  # started, nothing loaded: the runtime's own footprint
        # k = 3: each node's share is split across rounds; stream buffers as a plan gives them (in layers)
        nodes = ring.start(local.addresses[0], [3, 5, 2], buffers=[1.5, 1.0, 2.5])
        peaks, done = list(idle), threading.Event()

        def sample():
            while not done.is_set():
                for i, p in enumerate(procs):
                    peaks[i] = max(peaks[i], p.memory_info().rss)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        async def collect(prompt):
            async with PrimaClient(local.addresses[0]) as client:
                return [e.token_id async for e in client.generate(prompt, max_tokens=tokens) if isinstance(e, Token)]

        try:
            for prompt in prompts:
                assert asyncio.run(collect(prompt)) == reference[prompt], prompt
        finally:
            done.set()
            sampler.join()
        after = ring.walk(local.addresses[0])
        # a node whose window fits its buffer reads it all in its gaps and never waits; the others do
        assert any(info.stats.stall_s > 0 for _, info in after)
        for (_, start), (_, info), base, peak in zip(nodes, after, idle, peaks):
            s = info.stats
            assert s.resident_bytes <= info.mem_budget and info.mem_budget > 1  # raised to the minimum
            overhead = NODE_OVERHEAD + (TOKENIZER_OVERHEAD if info.role == "head" else 0)
            assert peak - base <= info.mem_budget + overhead, (
                f"{info.name}: RSS grew {(peak - base) / MB:.0f} MiB, budget {info.mem_budget / MB:.0f} MiB")
            assert s.disk_read_bytes - start.stats.disk_read_bytes >= 2 * tokens * 5 * 14 * MB // 2
            assert s.compute_s > 0

        async def too_long():  # more KV positions than the budgets keep room for: a clear error, not an overrun
            async with PrimaClient(local.addresses[0]) as client:
                return [e async for e in client.generate(prompts[0], max_tokens=4000)]

        with pytest.raises(PrimaError, match="leaves room for .* KV positions.*--mem-budget"):
            asyncio.run(too_long())
        assert asyncio.run(collect(prompts[1])) == reference[prompts[1]]  # and the ring serves on
    finally:
        local.stop()
    logs = "".join(p.read_text() for p in tmp_path.glob("node*.log"))
    assert "offload plan" in logs and "offload stats" in logs
    layer = layer_bytes(LayerStore(smol_store).config, torch.float32)
    for buffer in (int(1.5 * layer), layer, int(2.5 * layer)):  # each node took its buffer
        assert f"buffer={aligned(buffer)}" in logs
