"""A node's memory plan under a budget: which layer matrices stay resident, which stream, and how big the stream
buffer is; pure decisions of sizes and the visit order (tested with tables), performed by nodes/engine/prefetch.py.

Layers may differ in size (a GGUF's mixed types: Q6_K layers' int8 matrices beside Q4_K layers' int4), so every
size here is a layer's own."""

from dataclasses import dataclass, field, replace
from itertools import combinations

import torch

from nodes.engine.fused import STREAM_UNITS

DEPTH = 1  # default buffer without a plan: DEPTH + 1 layers (read one ahead of the one computing)
ALIGN = 64  # every unit in the buffer starts here: fp32 matmul rounding depends on it (like torch's allocator)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def parts_bytes(parts: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """Bytes a streamed unit's tensors (nodes.engine.fused.stream_parts) take in the buffer, each aligned."""
    return sum(aligned(torch.Size(shape).numel() * dt.itemsize) for dt, shape in parts.values())


@dataclass(frozen=True)
class MemoryPlan:
    """How a node holds its layers under a budget."""

    order: tuple[int, ...]  # the node's layers in visit order
    streamed: tuple[tuple[int, tuple[str, ...]], ...]  # (layer, its streamed units), in visit order
    buffer: int  # stream buffer bytes (0: nothing streamed)
    prefetch: bool  # read ahead (else load on demand)
    budget: int  # effective budget in bytes: the requested one, or the minimum when that was lower
    requested: int  # 0: unlimited
    # layer -> bytes of each of its matrices, aligned (layers of a GGUF's mixed types differ: a Q6_K attn_v's int8)
    unit_bytes: dict[int, dict[str, int]] = field(hash=False)
    small_bytes: int = 0  # a layer's norms and biases, always resident
    fixed_bytes: int = 0  # head units + KV reserve, always in memory

    @property
    def layer_bytes(self) -> int:
        """The largest layer's bytes."""
        return max(sum(units.values()) for units in self.unit_bytes.values()) + self.small_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes read from disk per token (one visit of every layer)."""
        return sum(self.unit_bytes[layer][u] for layer, units in self.streamed for u in units)

    @property
    def resident(self) -> frozenset[int]:
        """Layers with no streamed unit."""
        return frozenset(self.order) - {layer for layer, _ in self.streamed}

    @property
    def weight_bytes(self) -> int:
        """Layer memory: resident units, every layer's small tensors, and the stream buffer."""
        layers = sum(sum(self.unit_bytes[layer].values()) + self.small_bytes for layer in self.order)
        return layers - self.streamed_bytes + self.buffer

    @property
    def below_minimum(self) -> bool:
        return 0 < self.requested < self.budget


def merge_windows(order: list[int]) -> list[list[int]]:
    """The visit order cut into windows: runs of consecutive layers (computed in one go)."""
    out: list[list[int]] = []
    for layer in order:
        if out and out[-1][-1] + 1 == layer:
            out[-1].append(layer)
        else:
            out.append([layer])
    return out


def share(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders), each part <= its weight."""
    s = sum(weights)
    exact = [total * w / s for w in weights]
    parts = [int(e) for e in exact]
    for i in sorted(range(len(weights)), key=lambda i: parts[i] - exact[i])[:total - sum(parts)]:
        parts[i] += 1
    return parts


def spread_counts(total: int, lengths: list[int], lead: int) -> list[int]:
    """How many of `total` streamed layers each window gets: first up to `lead` each (what a gap before it
    can read ahead), then the rest evenly, so that every round's turns read alike (a round whose turns
    read little leaves the next round's gaps too short to read ahead in)."""
    leads = [min(lead, n) for n in lengths]
    if total <= sum(leads):
        return share(total, leads)
    counts, extra = list(leads), [0] * len(lengths)
    for _ in range(total - sum(leads)):  # one at a time to the window that has the fewest extra and room
        i = min((i for i in range(len(lengths)) if counts[i] < lengths[i]), key=lambda i: extra[i])
        counts[i] += 1
        extra[i] += 1
    return counts


def placement(window: list[int], count: int, lead: int) -> list[int]:
    """Which `count` layers of a window stream: `lead` at its start (read in the gap before it, used first,
    freeing the buffer at once), the rest at its end (read beside the compute of the resident ones)."""
    lead = min(lead, count)
    return window[:lead] + (window[len(window) - (count - lead):] if count > lead else [])


def partial_units(unit_bytes: dict[str, int], need: int) -> tuple[str, ...]:
    """The fewest bytes of one layer's units that cover `need` (0 < need < the layer's matrices)."""
    best: tuple[int, tuple[str, ...]] | None = None
    for r in range(1, len(STREAM_UNITS) + 1):
        for units in combinations(STREAM_UNITS, r):
            size = sum(unit_bytes[u] for u in units)
            if size >= need and (best is None or size < best[0]):
                best = (size, units)
    assert best is not None, (unit_bytes, need)
    return best[1]


def plan_memory(order: list[int], unit_bytes: dict[int, dict[str, int]], small_bytes: int, fixed_bytes: int,
                budget: int, prefetch: bool, buffer: int = 0) -> MemoryPlan:
    """Resident units and the stream buffer for `budget` bytes (0: unlimited); unit_bytes: each layer's matrices.

    Everything that fits stays resident. Otherwise a buffer of `buffer` bytes (0: DEPTH + 1 of the largest layers;
    at least the largest layer, exactly that without prefetch) and as many units resident as the rest of the budget
    holds: whole layers, then single units of one more layer. A budget below head + KV reserve + every
    layer's small tensors + the buffer runs at that minimum."""
    matrices = {layer: sum(unit_bytes[layer].values()) for layer in order}
    largest = max(matrices.values(), default=0)
    n = len(order)
    plan = dict(order=tuple(order), prefetch=prefetch, requested=budget,
                unit_bytes={layer: dict(unit_bytes[layer]) for layer in order}, small_bytes=small_bytes,
                fixed_bytes=fixed_bytes)
    if budget <= 0 or n == 0 or fixed_bytes + sum(matrices.values()) + n * small_bytes <= budget:
        return MemoryPlan(streamed=(), buffer=0, budget=budget if budget > 0 else 0, **plan)
    if not prefetch:
        buffer = largest
    buffer = max(aligned(buffer or (DEPTH + 1) * largest), largest)
    room = budget - fixed_bytes - n * small_bytes - buffer  # for resident matrices
    need = sum(matrices.values()) - max(room, 0)  # matrix bytes that stream
    windows = merge_windows(order)
    lead = max(1, buffer // largest)

    def chosen(count: int) -> list[int]:  # the layers that stream whole when `count` do
        counts = spread_counts(count, [len(w) for w in windows], lead)
        return [layer for w, c in zip(windows, counts) for layer in placement(w, c, lead)]

    # the fewest whole layers that cover `need`; one fewer and part of another where that covers it too
    whole = next((c for c in range(n + 1) if sum(matrices[x] for x in chosen(c)) >= need), n)
    units = {layer: STREAM_UNITS for layer in chosen(whole)}
    rest = need - sum(matrices[x] for x in chosen(whole - 1)) if whole else 0
    if 0 < whole < n and sum(matrices[x] for x in units) > need:
        counts = spread_counts(whole - 1, [len(w) for w in windows], lead)
        # the partial layer closes the window that streams least (its reads beside most compute)
        i = min((i for i, w in enumerate(windows) if counts[i] < len(w)), key=lambda i: (counts[i], -i))
        (extra,) = set(placement(windows[i], counts[i] + 1, lead)) - set(placement(windows[i], counts[i], lead))
        if rest < matrices[extra]:  # layers alike always; else it may be too small to cover the rest
            units = {layer: STREAM_UNITS for layer in chosen(whole - 1)}
            units[extra] = partial_units(unit_bytes[extra], rest)
    streamed = tuple((layer, units[layer]) for layer in order if layer in units)
    out = MemoryPlan(streamed=streamed, buffer=buffer, budget=budget, **plan)
    return replace(out, budget=max(budget, fixed_bytes + out.weight_bytes))
