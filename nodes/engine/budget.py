"""A shard's memory budget: the bytes its head, KV reserve and layers take, and the plan that fits them in it."""

from dataclasses import dataclass

import torch

from nodes.engine.formats import Format
from nodes.engine.fused import STREAM_UNITS, expert_bytes, head_bytes, kv_bytes, layer_bytes, stream_parts
from nodes.engine.kv_dtype import FLOAT, KVDtype
from nodes.engine.memory_plan import MemoryPlan, parts_bytes, plan_memory
from nodes.engine.prefetch import kv_reserve_tokens
from prima_rpc.spec.manifest import ModelConfig, StoreError
from prima_rpc.spec.shapes import layer_params, matrix_params
from prima_rpc.spec.windows import Windows


@dataclass(frozen=True)
class ShardBudget:
    plan: MemoryPlan
    # KV caches get what the budget leaves after weights and head (at least the reserve); None: no budget
    kv_room: int | None
    expert_room: int | None = None  # a mixture whose experts do not all fit: bytes of its expert cache


def shard_budget(cfg: ModelConfig, windows: Windows, dtype: torch.dtype, fmt: Format | None,
                 head_fmt: Format | None, budget: int, prefetch: bool, buffer: int,
                 default_budget: bool = False, kv_dtype: KVDtype = FLOAT, ctx: int = 0) -> ShardBudget:
    """The memory plan of the windows' layers (matrices in `fmt`, None: float) computing in `dtype`, beside the
    head (its embedding in `head_fmt`) and a KV reserve in `kv_dtype` of `ctx` positions, all requests together
    (0: kv_reserve_tokens, the whole context for the default budget); budget and buffer in bytes as
    nodes.engine.memory_plan.plan_memory takes them (0: unlimited, 0: the default buffer)."""
    order = sorted(windows.layers())
    head_mem = head_bytes(cfg, dtype, head_fmt) if windows.head else 0
    reserve = ctx or kv_reserve_tokens(cfg, default_budget)
    fixed = head_mem + kv_bytes(cfg, dtype, order, reserve, kv_dtype)
    if cfg.moe:
        return resident_moe(cfg, order, dtype, fmt, budget, prefetch, fixed, head_mem)
    units = {i: {u: parts_bytes(stream_parts(u, cfg, fmt and fmt.layer(i), dtype)) for u in STREAM_UNITS}
             for i in order}  # each layer in its own formats
    small = (layer_params(cfg) - matrix_params(cfg)) * dtype.itemsize  # norms (Gemma's four, q/k norms) and biases
    if default_budget and order:  # what the device has is all there is: room for a unit read beside its copy kept
        # (a quantized layer is read whole, then repacked; 136 MB over the budget killed a testbed device at its
        # memory group's limit while it loaded an 8B-shaped int4 window)
        fixed += max(sum(units[i].values()) for i in order)
    plan = plan_memory(order, units, small, fixed, budget, prefetch, buffer)
    return ShardBudget(plan, plan.budget - plan.weight_bytes - head_mem if plan.budget else None)


def resident_moe(cfg: ModelConfig, order: list[int], dtype: torch.dtype, fmt: Format | None, budget: int,
                 prefetch: bool, fixed: int, head_mem: int) -> ShardBudget:
    """A mixture of experts' layers: dense parts always resident; every expert too where the budget holds them,
    else as many as a cache of the rest holds (nodes/engine/expert_cache.py), at least one step's top-k."""
    layer = layer_bytes(cfg, dtype, fmt)
    plan = MemoryPlan(tuple(order), (), 0, prefetch, budget, budget, {i: {"layer": layer} for i in order}, 0, fixed)
    if not budget or plan.weight_bytes + fixed <= budget:
        return ShardBudget(plan, budget - plan.weight_bytes - head_mem if budget else None)
    one = expert_bytes(cfg, dtype, fmt)
    dense = layer - cfg.n_experts * one
    room = budget - fixed - dense * len(order)
    if room < cfg.n_experts_used * one:
        raise StoreError(f"the memory budget ({budget >> 20} MiB) cannot hold this node's {len(order)} mixture-of-"
                         f"experts layers' dense parts and {cfg.n_experts_used} experts "
                         f"({(fixed + dense * len(order) + cfg.n_experts_used * one) >> 20} MiB with the head and KV "
                         "reserve): raise --mem-budget or give it fewer layers")
    plan = MemoryPlan(tuple(order), (), 0, prefetch, budget, budget, {i: {"layer": dense} for i in order}, 0, fixed)
    return ShardBudget(plan, budget - plan.weight_bytes - room - head_mem, expert_room=room)
