"""Experts a node's budget cannot all hold: the dense parts stay resident, the experts live in a cache of the rest
of the budget, and a step's missing experts are all asked of the reader thread as soon as the router has chosen them
(the step computes its cached experts and the shared expert meanwhile, nodes/engine/moe.py). The policy (least
frequently used) was chosen by hit rate on recorded routing (nodes/engine/expert_policy.py, docs/moe.md). The
cache counts bytes by kind: dense (read at load only), expert hits (from memory) and expert misses (from disk)."""

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nodes.engine.expert_policy import POLICIES, Key, warm_keys
from nodes.engine.formats import Format
from nodes.engine.fused import expert_bytes
from nodes.engine.model import expert
from nodes.engine.moe import Expert, ExpertSource
from nodes.engine.store import LayerStore
from prima_rpc.spec.manifest import ModelConfig, StoreError, expert_unit

POLICY = "frequency"  # the measured best (docs/moe.md): ahead of LRU with small caches, equal with larger ones


class ExpertCache:
    """Up to `capacity` bytes of experts of the given layers, evicted by `policy` (POLICIES)."""

    def __init__(self, store: LayerStore, cfg: ModelConfig, dtype: torch.dtype, fmt: Format | None, capacity: int,
                 layers: list[int], policy: str = POLICY):
        self.store, self.cfg, self.dtype, self.fmt, self.capacity = store, cfg, dtype, fmt, capacity
        self.one = expert_bytes(cfg, dtype, fmt)  # every expert's memory
        self.policy = POLICIES[policy]()
        self.held: dict[Key, Expert | Future] = {}  # a Future: a miss of the step being computed, still read
        # "dense": read before the cache (the shard's dense parts: always kept, never read again), "expert_hit",
        # "expert_miss" (read from disk)
        self.bytes = Counter(dense=store.bytes_read)
        self.routed: list[tuple[int, tuple[int, ...]]] = []  # (layer, experts) of each step, in order
        for key in warm_keys(layers, cfg.n_experts)[:capacity // self.one]:  # at load: not counted as misses
            self.held[key] = self._read(*key)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="experts")  # misses, in the order asked

    @property
    def held_bytes(self) -> int:
        return len(self.held) * self.one

    def _read(self, i: int, e: int) -> Expert:
        try:
            return expert(self.store.new_tensors(expert_unit(i, e), None), self.dtype, self.fmt)
        except StoreError as exc:  # the node fails the request (ValueError) rather than the whole loop
            raise ValueError(f"layer {i}'s expert {e} could not be read: {exc}") from None

    def source(self, i: int) -> ExpertSource:
        """Layer i's experts for MoE.experts: the chosen ones, hits from memory and misses being read."""
        return lambda ids: self.get(i, ids)

    def get(self, i: int, ids: list[int]) -> dict[int, Expert | Future]:
        """The experts `ids` of layer i: the cached ones, and Futures of the missing ones, all asked of the reader
        at once, in the order given (the order the step will use them)."""
        self.routed.append((i, tuple(ids)))
        out = {}
        for e in ids:
            x = self.held.get((i, e))
            if isinstance(x, Future) and x.done():  # read during an earlier step
                x = x.result() if x.exception() is None else None  # a failed read (its request failed): again
            if x is not None:
                self.bytes["expert_hit"] += self.one
            else:
                self.bytes["expert_miss"] += self.store.entry(expert_unit(i, e)).bytes
                x = self.reader.submit(self._read, i, e)
            self.held[(i, e)] = out[e] = x
        self.policy.use(i, ids)
        step = {(i, e) for e in ids}  # this step's experts stay: it needs them all at once
        for key in self.policy.victims(set(self.held) - step, len(self.held) - max(self.capacity // self.one,
                                                                                    len(step))):
            del self.held[key]
        return out

    def close(self) -> None:
        self.reader.shutdown(wait=True)
