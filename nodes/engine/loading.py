"""Reading a shard's weights from its layer store: the head, resident layers, and what streamed layers keep."""

from collections.abc import Callable
from typing import NamedTuple

import torch

from nodes.engine.formats import Format
from nodes.engine.fused import (
    STREAM_UNITS,
    empty_layer,
    empty_parts,
    empty_small,
    layer_targets,
    part_targets,
    part_weight,
    small_targets,
)
from nodes.engine.memory_plan import MemoryPlan
from nodes.engine.model import Layer, OutputHead, Weight, expert, head_numerics, mixture
from nodes.engine.prefetch import Prefetcher
from nodes.engine.store import LayerStore
from prima_rpc.spec.manifest import ModelConfig, expert_unit
from prima_rpc.spec.windows import Windows


def shard_units(windows: Windows, n_experts: int = 0) -> list[str]:
    """The units a shard of these windows loads, in the order it loads them (n_experts: each layer's experts)."""
    layers = [[expert_unit(i, e) for e in range(n_experts)] + [f"layer.{i}"] for i in sorted(windows.layers())]
    return (["embed", "head"] if windows.head else []) + [u for units in layers for u in units]


class ReportingStore:
    """A layer store that reports each unit read through it: progress(done, total, unit) in the manifest's bytes
    of the units read so far, out of `units`."""

    def __init__(self, store: LayerStore, units: list[str], progress: Callable[[int, int, str], None]):
        self.store, self.progress = store, progress
        self.total = sum(store.entry(u).bytes for u in units)
        self.done = 0

    def _loaded(self, unit: str) -> None:
        self.done += self.store.entry(unit).bytes
        self.progress(self.done, self.total, unit)

    def needs_check(self, unit: str) -> bool:
        return self.store.needs_check(unit)

    def new_tensors(self, unit: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        out = self.store.new_tensors(unit, dtype)
        self._loaded(unit)
        return out

    def read_into(self, unit: str, targets: dict[str, torch.Tensor]) -> int:
        n = self.store.read_into(unit, targets)
        self._loaded(unit)
        return n

    def read_part(self, unit: str, targets: dict[str, torch.Tensor]) -> int:
        n = self.store.read_part(unit, targets)
        self._loaded(unit)
        return n


Store = LayerStore | ReportingStore


def load_head(store: Store, cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None) -> OutputHead:
    """The embedding, final norm and output (float stores' tensors read as `dtype`, quantized ones' as stored)."""
    embed = store.new_tensors("embed", dtype if fmt is None else None)
    head = store.new_tensors("head", dtype if fmt is None else None)
    return OutputHead.from_units(embed, head, dtype, cfg.tie_embeddings, fmt, **head_numerics(cfg))


def load_resident(store: Store, i: int, cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None,
                  experts: list[int] | None = None) -> Layer:
    """Layer i whole: float matrices read straight into their fused buffers, quantized ones as the kernel's
    weights made from the stored tensors (a mixture: with the experts `experts`, None: all)."""
    if cfg.moe:
        return read_layer(store, i, cfg, dtype, fmt, experts)
    if fmt is None:
        layer = empty_layer(cfg, dtype)
        store.read_into(f"layer.{i}", layer_targets(layer, cfg))
        return layer
    return Layer.from_unit(store.new_tensors(f"layer.{i}", None), dtype, fmt)


def read_layer(store: Store, i: int, cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None,
               experts: list[int] | None = None) -> Layer:
    """Layer i from its unit's tensors as stored: Layer.from_unit's, with a mixture's experts (`experts`; None:
    all) read from their own units; its matrices in layer i's formats (Format.layer)."""
    fmt = fmt and fmt.layer(i)
    unit = store.new_tensors(f"layer.{i}", None)
    if not cfg.moe:
        return Layer.from_unit(unit, dtype, fmt)
    held = {e: expert(store.new_tensors(expert_unit(i, e), None), dtype, fmt)
            for e in (range(cfg.n_experts) if experts is None else experts)}
    return Layer.from_unit(unit, dtype, fmt, moe=lambda t: mixture(t, held, dtype, fmt, cfg))


def load_streamed(store: Store, i: int, cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None,
                  streamed: tuple[str, ...], scratch: Callable[[int], dict[str, dict[str, torch.Tensor]]],
                  ) -> tuple[dict[str, torch.Tensor | None], dict[str, Weight]]:
    """(norms and biases, matrices that stay) of streamed layer i, whose `streamed` units stream. A unit whose
    checksum is unchecked is read whole, into the stream buffer (scratch()), so that a bad file fails the
    assignment; otherwise only what stays is read."""
    unit = f"layer.{i}"
    small = empty_small(cfg, dtype)
    targets = small_targets(small, cfg)
    if store.needs_check(unit):
        buffer = scratch(i)
        for u in STREAM_UNITS:
            targets.update(part_targets(u, buffer[u], cfg, fmt))
        store.read_into(unit, targets)
        kept = {u: {k: t.clone() for k, t in buffer[u].items()} for u in STREAM_UNITS if u not in streamed}
    else:
        kept = {u: empty_parts(u, cfg, fmt, dtype) for u in STREAM_UNITS if u not in streamed}
        for u, parts in kept.items():
            targets.update(part_targets(u, parts, cfg, fmt))
        store.read_part(unit, targets)
    return small, {u: part_weight(u, parts, fmt, dtype) for u, parts in kept.items()}


class LayerWeights(NamedTuple):
    resident: dict[int, Layer]
    small: dict[int, dict]  # streamed layers: their norms and biases
    kept: dict[int, dict]  # streamed layers: their resident matrices


def load_layers(store: Store, plan: MemoryPlan, cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None,
                prefetcher: Prefetcher | None, experts: list[int] | None = None) -> LayerWeights:
    """The plan's layers in visit order, each in its own formats (fmt.layer): resident ones whole (a mixture's with the
    experts `experts`, None: all), streamed ones what stays of them (reading through the prefetcher's buffer before
    it starts)."""
    out = LayerWeights({}, {}, {})
    streamed = dict(plan.streamed)
    for i in plan.order:
        f = fmt and fmt.layer(i)
        if i in plan.resident:
            out.resident[i] = load_resident(store, i, cfg, dtype, f, experts)
        else:
            out.small[i], out.kept[i] = load_streamed(store, i, cfg, dtype, f, streamed[i], prefetcher.scratch)
    return out
