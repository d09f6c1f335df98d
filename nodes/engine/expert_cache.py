"""Experts a node's budget cannot all hold: the dense parts stay resident, the experts live in a cache of the rest
of the budget, and a step's missing experts are read as soon as the router has chosen them. Policy: least recently
used (the first one; frequency or router-history policies are left to measurement). The reader counts bytes by
kind: dense (read at load only), expert hits (served from memory) and expert misses (read from disk)."""

from collections import Counter, OrderedDict

import torch

from nodes.engine.model import expert, nbytes
from nodes.engine.moe import Expert, ExpertSource
from nodes.engine.quant import Format
from nodes.engine.store import LayerStore
from prima_rpc.spec.manifest import ModelConfig, StoreError, expert_unit


class ExpertCache:
    """Up to `capacity` bytes of experts of the given layers, least recently used evicted first."""

    def __init__(self, store: LayerStore, cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None, capacity: int,
                 layers: list[int]):
        self.store, self.cfg, self.dtype, self.fmt, self.capacity = store, cfg, dtype, fmt, capacity
        self.held: OrderedDict[tuple[int, int], Expert] = OrderedDict()
        self.held_bytes = 0
        # "dense": read before the cache (the shard's dense parts: always kept, never read again), "expert_hit",
        # "expert_miss" (read from disk)
        self.bytes = Counter(dense=store.bytes_read)
        self.routed: list[tuple[int, tuple[int, ...]]] = []  # (layer, experts) of each step, in order
        self._warm(layers)

    def _warm(self, layers: list[int]) -> None:
        """Fill the cache at load, experts in turn from every layer, as far as it holds (not counted as misses)."""
        for e in range(self.cfg.n_experts):
            for i in layers:
                x = self._read(i, e)
                if self.held_bytes + size(x) > self.capacity:
                    return
                self.held[(i, e)] = x
                self.held_bytes += size(x)

    def _read(self, i: int, e: int) -> Expert:
        try:
            return expert(self.store.new_tensors(expert_unit(i, e), None), self.dtype, self.fmt)
        except StoreError as exc:  # the node fails the request (ValueError) rather than the whole loop
            raise ValueError(f"layer {i}'s expert {e} could not be read: {exc}") from None

    def source(self, i: int) -> ExpertSource:
        """Layer i's experts for MoE.experts: the chosen ones, hits from memory and misses read now."""
        return lambda ids: self.get(i, ids)

    def get(self, i: int, ids: list[int]) -> dict[int, Expert]:
        self.routed.append((i, tuple(ids)))
        out = {}
        for e in ids:
            x = self.held.get((i, e))
            if x is not None:
                self.held.move_to_end((i, e))
                self.bytes["expert_hit"] += size(x)
            else:
                before = self.store.bytes_read
                x = self._read(i, e)
                self.bytes["expert_miss"] += self.store.bytes_read - before
                self.held[(i, e)] = x
                self.held_bytes += size(x)
            out[e] = x
        self._evict(keep={(i, e) for e in ids})
        return out

    def _evict(self, keep: set[tuple[int, int]]) -> None:
        """Least recently used first; this step's experts stay (the step needs them all at once)."""
        for key in list(self.held):
            if self.held_bytes <= self.capacity:
                return
            if key not in keep:
                self.held_bytes -= size(self.held.pop(key))


def size(x: Expert) -> int:
    return nbytes(x.w_gate_up) + nbytes(x.w_down)
