"""Disk offload's decisions as tables: the memory plan (shares, rounds, placement, the buffer's arena), and the
prefetcher's reads (each unit once per use, in order; re-aimed after a misprediction) on a store that sleeps."""

import time

import pytest
import torch

from nodes.engine.memory_plan import aligned, placement, plan_memory, share, spread_counts
from nodes.engine.model import STAGES
from nodes.engine.prefetch import Prefetcher, arena_alloc, fits_alone
from nodes.engine.store import LayerStore
from prima_rpc.spec.shapes import matrix_shapes

MB = 1 << 20

UNITS = {"wqkv": MB // 8, "wo": MB // 8, "w_gate_up": MB // 2, "w_down": MB // 4}  # a 1 MB layer's matrices


def alike(order: list[int], units: dict[str, int] = UNITS) -> dict[int, dict[str, int]]:
    """Every layer's matrices the same size."""
    return {layer: units for layer in order}


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
    plan = plan_memory(order, alike(order), 0, 5 * MB, budget, prefetch, buffer)  # head + KV reserve 5 MB
    assert (plan.streamed_bytes, plan.buffer, plan.prefetch, plan.budget) == (
        streamed_bytes, buffer_bytes, prefetch, effective)
    layers = [layer for layer, _ in plan.streamed]
    assert layers == sorted(layers) and set(layers) | plan.resident == set(order)  # visit order
    assert sum(len(us) < 4 for _, us in plan.streamed) <= 1  # at most one layer keeps some matrices
    if plan.streamed:
        assert plan.fixed_bytes + plan.weight_bytes <= plan.budget
        assert plan.below_minimum == (budget < effective)


def test_streamed_layers_lead_and_close_each_window():
    order = [0, 1, 2, 3, 10, 11, 12, 13]
    plan = plan_memory(order, alike(order), 0, 0, 6 * MB, True, MB)  # 1 MB buffer, 5 resident
    assert [layer for layer, _ in plan.streamed] == [0, 3, 10]  # windows of 4: 2 (first, last) and 1 (first)


MIXED = {layer: UNITS if layer % 2 else {u: 2 * n for u, n in UNITS.items()} for layer in range(8)}  # 2 MB, 1 MB...


@pytest.mark.parametrize("budget", [MB * b // 4 for b in range(1, 64)])
def test_layers_of_different_sizes_stream_what_the_budget_cannot_hold(budget):
    """A GGUF's mixed types make layers of different sizes (Q6_K layers' int8 matrices): the buffer holds the
    largest, and the streamed units cover what the rest of the budget does not, by each layer's own bytes."""
    plan = plan_memory(list(range(8)), MIXED, MB // 16, MB, budget, True)
    matrices = sum(sum(u.values()) for u in MIXED.values())  # 12 MB
    if not plan.streamed:
        assert MB + 8 * MB // 16 + matrices <= budget
        return
    assert plan.buffer == 2 * 2 * MB  # two of the largest layers
    assert plan.fixed_bytes + plan.weight_bytes <= plan.budget
    assert sum(len(us) < 4 for _, us in plan.streamed) <= 1  # at most one layer keeps some matrices
    assert plan.weight_bytes == 8 * MB // 16 + matrices - plan.streamed_bytes + plan.buffer
    if budget >= MB + 8 * MB // 16 + plan.buffer:  # above the minimum: what streams is what the budget cannot hold
        assert plan.budget == budget and not plan.below_minimum
        need = MB + 8 * MB // 16 + plan.buffer + matrices - budget
        assert need <= plan.streamed_bytes < need + 2 * MB  # less than one more (large) layer
    else:
        assert plan.streamed_bytes == matrices and plan.below_minimum


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
    return plan_memory(list(range(8)), alike(list(range(8)), units), 0, 0, int(budget_layers * layer), prefetch,
                       int(buffer_layers * layer))


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
        assert len(store.reads) - len(uses) <= plan.buffer // min(plan.unit_bytes[0].values())  # what the buffer holds
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
