"""Plan value types (a layer-to-device assignment and its prediction) and its half-open layer ranges."""

from __future__ import annotations

from dataclasses import dataclass

from solver.cost_model import Instance, device_costs, evaluate, memory_bytes

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


@dataclass(frozen=True)
class Plan:
    k: int  # rounds per token
    devices: tuple[DevicePlan, ...]  # ring order, head first (removed ones included)
    predicted_tpot_s: float
    solve_ms: float
    strategy: str = "halda"

    @property
    def windows(self) -> list[int]:
        return [d.window for d in self.devices]

    @property
    def gpu_layers(self) -> list[int]:
        return [d.gpu_layers for d in self.devices]

    @property
    def in_ring(self) -> list[bool]:
        return [d.role != "removed" for d in self.devices]

    def layer_ranges(self, n_layers: int) -> list[list[tuple[int, int]]]:
        return layer_ranges(self.windows, n_layers)


@dataclass(frozen=True)
class Infeasible:
    reason: str
    solve_ms: float = 0.0


def layer_ranges(windows: list[int], n_layers: int) -> list[list[tuple[int, int]]]:
    """Half-open layer ranges per device (ring order, head first) in prima.cpp order: each round
    goes to ranks 1..M-1 and then rank 0, so the head holds the last window of every round."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if any(w < 0 for w in windows):
        raise ValueError(f"windows must be >= 0, got {windows}")
    W = sum(windows)
    if W == 0:
        raise ValueError(f"at least one window must be > 0, got {windows}")
    if n_layers % W:
        raise ValueError(f"sum(windows)={W} does not divide n_layers={n_layers}")
    out: list[list[tuple[int, int]]] = [[] for _ in windows]
    order = list(range(1, len(windows))) + [0]
    start = 0
    for _ in range(n_layers // W):  # rounds
        for m in order:
            if windows[m]:
                out[m].append((start, start + windows[m]))
                start += windows[m]
    return out


def even_windows(n_layers: int, nodes: int) -> list[int]:
    """One round (k = 1) as even as the layer count allows; the head (first) takes the remainder."""
    base, extra = divmod(n_layers, nodes)
    return [base + extra] + [base] * (nodes - 1)


def build_plan(inst: Instance, k: int, w: list[int], n: list[int], in_ring: list[bool] | None,
               solve_ms: float, strategy: str, prefetch: bool = True) -> Plan:
    """Turn an assignment into a Plan with the cost model's prediction."""
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
            buffer_layers=br.buffer_bytes[i] / c.b))
    return Plan(k, tuple(devs), br.tpot_s, solve_ms, strategy)
