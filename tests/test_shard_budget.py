"""A shard's budget maths (nodes/engine/budget.py) on the tiny preset, as a table: what streams, the buffer, the
effective budget and the KV room it leaves."""

import pytest
import torch

from nodes.engine.budget import shard_budget
from nodes.engine.formats import Format
from nodes.engine.fused import head_bytes, kv_bytes, layer_bytes
from prima_rpc.spec.shapes import PRESETS
from prima_rpc.spec.windows import Windows

CFG = PRESETS["tiny"]  # fp32 layers of 147 968 bytes (147 456 of matrices), 8 layers, 512 positions
HEAD = Windows(((0, 8),), 8, True)
TWO = Windows(((2, 4), (6, 8)), 8, False)  # k = 2, no head
ALL = [f"{i}" for i in range(8)]
RESERVE = kv_bytes(CFG, torch.float32, 8, 512)  # 1 MiB: the KV reserve of 8 layers
MATRICES = 147_456


def streamed(plan) -> list[str]:
    """The plan's streamed layers as the shard logs them: "3", or "3(wo,w_down)" for some of its matrices."""
    return [f"{layer}" + ("" if len(us) == 4 else f"({','.join(us)})") for layer, us in plan.streamed]


@pytest.mark.parametrize("windows, fmt, budget, prefetch, buffer, layers, buffer_bytes, effective, kv_room", [
    (HEAD, None, 0, True, 0, [], 0, 0, None),  # no budget: all resident, no limit on the KV caches
    (HEAD, None, 10**9, True, 0, [], 0, 10**9, 10**9 - 8 * 147_968 - head_bytes(CFG, torch.float32)),
    (HEAD, None, 1, True, 0, ALL, 2 * MATRICES, 1_429_760, RESERVE),  # below the minimum: runs at it
    (HEAD, None, 1, False, 0, ALL, MATRICES, 1_282_304, RESERVE),  # on demand: one layer of buffer
    (TWO, None, 970_000, True, 0, ["2", "6", "7"], 2 * MATRICES, 970_000, 525_584),  # each window's lead, end
    (TWO, None, 900_000, True, 30_000, ["2", "6", "7(wo,w_gate_up)"], MATRICES, 900_000, 537_504),
    (TWO, Format("int8"), 700_000, True, 0, [], 0, 700_000, 700_000 - 4 * layer_bytes(CFG, torch.float32,
                                                                                      Format("int8"))),
], ids=["unlimited", "fits", "minimum", "on-demand", "k2-streams", "k2-partial-layer", "int8-fits"])
def test_shard_budget(windows, fmt, budget, prefetch, buffer, layers, buffer_bytes, effective, kv_room):
    b = shard_budget(CFG, windows, torch.float32, fmt, fmt, budget, prefetch, buffer)
    assert (streamed(b.plan), b.plan.buffer, b.plan.budget, b.kv_room) == (layers, buffer_bytes, effective, kv_room)
    if kv_room is not None:  # the KV room is what the budget leaves beside weights and head
        head = head_bytes(CFG, torch.float32, fmt) if windows.head else 0
        reserve = kv_bytes(CFG, torch.float32, len(windows.layers()), 512)
        assert b.kv_room == b.plan.budget - b.plan.weight_bytes - head >= reserve
