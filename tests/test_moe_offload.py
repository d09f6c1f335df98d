"""A node whose budget holds a quarter of its experts: the dense parts stay, the experts live in an LRU cache, a
step's missing experts are read once the router chose them; tokens equal the single process, and the reader's
counters show only the routed experts that were missing were read."""

import threading
from concurrent.futures import Future

import pytest
import torch

from nodes.engine.fused import expert_bytes, head_bytes, kv_bytes, layer_bytes
from nodes.engine.model import expert
from nodes.engine.prefetch import KV_RESERVE_TOKENS
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.manifest import expert_unit
from prima_rpc.spec.windows import Windows
from tools.synth import synth

PROMPT = [1, 5, 9, 30, 77, 12, 40]
STEPS = 10


@pytest.fixture(scope="module", params=["tiny-qwen3moe", "tiny-qwen2moe"])
def store(request, tmp_path_factory):
    return synth(tmp_path_factory.mktemp("moe") / request.param, request.param, seed=6)


def budget_for(cfg, share: float) -> int:
    """Head, KV reserve and every dense part, and `share` of the experts."""
    one = expert_bytes(cfg, torch.float32)
    dense = layer_bytes(cfg, torch.float32) - cfg.n_experts * one
    fixed = head_bytes(cfg, torch.float32) + kv_bytes(cfg, torch.float32, cfg.n_layers,
                                                      min(KV_RESERVE_TOKENS, cfg.max_seq_len))
    return fixed + cfg.n_layers * dense + int(share * cfg.n_layers * cfg.n_experts) * one


def greedy(shard: Shard) -> list[int]:
    cache = shard.cache_for("r", 0, len(PROMPT) + STEPS, len(PROMPT))
    h, _ = shard.compute(shard.embed(PROMPT), cache, 0, 0)
    ids = [int(shard.logits(h).argmax())]
    for _ in range(STEPS - 1):
        h, _ = shard.compute(shard.embed(ids[-1:]), cache, len(PROMPT) + len(ids) - 1, 0)
        ids.append(int(shard.logits(h).argmax()))
    return ids


def reference(store) -> list[int]:
    model = ReferenceModel(store)
    cache = model.new_cache(len(PROMPT) + STEPS)
    ids = [int(model.step_all(PROMPT, 0, cache)[-1].argmax())]
    for _ in range(STEPS - 1):
        ids.append(int(model.step([ids[-1]], len(PROMPT) + len(ids) - 1, cache).argmax()))
    return ids


def test_a_quarter_of_the_experts_gives_the_same_tokens_reading_only_missing_routed_experts(store):
    s = LayerStore(store)
    cfg = s.config
    shard = Shard(s, Windows(((0, cfg.n_layers),), cfg.n_layers, True), torch.float32, budget=budget_for(cfg, 0.25))
    cache = shard.experts
    assert cache is not None and cache.held_bytes <= cache.capacity
    one = expert_bytes(cfg, torch.float32)
    assert len(cache.held) == cfg.n_layers * cfg.n_experts // 4  # warm: a quarter resident from the start
    loaded = s.bytes_read
    assert greedy(shard) == reference(store)
    routed = sum(len(ids) for _, ids in cache.routed)
    assert len(cache.routed) == STEPS * cfg.n_layers  # the router chose once per layer per step
    b = cache.bytes
    # every byte read after load was a missing routed expert's, each read once (a unit file: the expert's bytes
    # plus its safetensors header)
    assert s.bytes_read - loaded == b["expert_miss"]
    misses = b["expert_miss"] // s.entry("layer.0.expert.0").bytes
    assert 0 < misses < routed and b["expert_hit"] == (routed - misses) * one
    assert b["expert_miss"] <= routed * s.entry("layer.0.expert.0").bytes
    assert cache.held_bytes <= cache.capacity  # the budget held


def test_a_budget_for_every_expert_reads_nothing_while_decoding(store):
    s = LayerStore(store)
    cfg = s.config
    shard = Shard(s, Windows(((0, cfg.n_layers),), cfg.n_layers, True), torch.float32, budget=budget_for(cfg, 1.0))
    assert shard.experts is None  # all resident
    loaded = s.bytes_read
    assert greedy(shard) == reference(store)
    assert s.bytes_read == loaded


class GatedStore(LayerStore):
    """A layer store whose expert reads wait for `gate` once armed (to see what runs while they are in flight)."""

    def __init__(self, root):
        super().__init__(root)
        self.armed, self.gate = False, threading.Event()

    def new_tensors(self, unit, dtype):
        if self.armed and ".expert." in unit:
            assert self.gate.wait(30)
        return super().new_tensors(unit, dtype)


def test_a_steps_missing_experts_are_all_asked_for_at_once_and_the_cached_ones_served_meanwhile(store):
    s = GatedStore(store)
    cfg = s.config
    shard = Shard(s, Windows(((0, cfg.n_layers),), cfg.n_layers, True), torch.float32, budget=budget_for(cfg, 0.25))
    cache = shard.experts
    held = sorted(e for i, e in cache.held if i == 0)
    missing = sorted(set(range(cfg.n_experts)) - set(held))[:3]
    s.armed = True
    got = cache.get(0, held[:1] + missing)  # returns while every read waits
    assert not isinstance(got[held[0]], Future)
    assert all(isinstance(got[e], Future) and not got[e].done() for e in missing)
    s.gate.set()
    for e in missing:
        x = got[e].result(timeout=30)
        direct = expert(s.new_tensors(expert_unit(0, e), None), torch.float32, None)
        assert torch.equal(x.w_gate_up, direct.w_gate_up) and torch.equal(x.w_down, direct.w_down)
    again = cache.get(0, missing)  # now cached, as experts (no longer futures)
    assert all(not isinstance(again[e], Future) for e in missing)
    shard.close()
