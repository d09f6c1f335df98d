"""The ring plan (a layer-to-device assignment and its prediction) and its half-open layer ranges.

A window here is a count: w_m, the layers device m computes in each round (`window_sizes`); the layer
ranges those make (what nodes call their windows) come from `layer_ranges`."""

from __future__ import annotations

from dataclasses import dataclass

from prima_rpc.spec.windows import layer_ranges
from solver.cost_model import Instance, device_costs, evaluate
from solver.device_terms import expert_reads, memory_bytes

ROLES = ("head", "worker", "relay", "removed")


@dataclass(frozen=True)
class DevicePlan:
    name: str
    role: str  # head | worker | relay | removed
    window: int  # w: layers per round
    gpu_layers: int  # n: of those, on the GPU
    set_label: str  # M1..M4, "-" when removed
    memory_bytes: int  # resident RAM + VRAM
    predicted_s: float  # per token: compute beside disk reads, outgoing hops (+ output layer on the head)
    buffer_layers: float = 0.0  # its stream buffer in layers (0: it does not stream)
    # a mixture of experts, per token: bytes of the experts its layers route to, and of those the expected misses
    # it reads from disk (device_terms.expert_reads: uniform routing assumed)
    routed_expert_bytes: int = 0
    expert_read_bytes: int = 0


@dataclass(frozen=True)
class RingPlan:
    k: int  # rounds per token
    devices: tuple[DevicePlan, ...]  # ring order, head first (removed ones included)
    predicted_tpot_s: float
    solve_ms: float
    strategy: str = "halda"

    @property
    def window_sizes(self) -> list[int]:
        return [d.window for d in self.devices]

    @property
    def gpu_layers(self) -> list[int]:
        return [d.gpu_layers for d in self.devices]

    @property
    def in_ring(self) -> list[bool]:
        return [d.role != "removed" for d in self.devices]

    def layer_ranges(self, n_layers: int) -> list[list[tuple[int, int]]]:
        return layer_ranges(self.window_sizes, n_layers)


@dataclass(frozen=True)
class Infeasible:
    reason: str
    solve_ms: float = 0.0


def build_plan(inst: Instance, k: int, w: list[int], n: list[int], in_ring: list[bool] | None,
               solve_ms: float, strategy: str, prefetch: bool = True) -> RingPlan:
    """Turn an assignment into a RingPlan with the cost model's prediction."""
    cs = device_costs(inst)
    if in_ring is None:
        in_ring = [wm > 0 or not c.routable for c, wm in zip(cs, w)]
    br = evaluate(inst, k, w, n, in_ring, prefetch=prefetch)
    extra = inst.model.head_extra_bytes
    busy = br.busy_s
    devs = []
    for i, (c, wm, nm, r) in enumerate(zip(cs, w, n, in_ring)):
        role = "head" if i == 0 else ("removed" if not r else ("worker" if wm else "relay"))
        devs.append(DevicePlan(
            name=c.name, role=role, window=wm, gpu_layers=nm, set_label=br.labels[i],
            memory_bytes=memory_bytes(c, k, wm, nm, extra if c.is_head else 0) if r else 0,
            predicted_s=busy[i],
            buffer_layers=br.buffer_bytes[i] / c.b, routed_expert_bytes=k * wm * inst.model.routed_bytes,
            expert_read_bytes=int(expert_reads(c, k, wm, nm)) if r else 0))
    return RingPlan(k, tuple(devs), br.tpot_s, solve_ms, strategy)
