"""Which cached experts to evict: least recently used, least frequently used, or least used in the router's recent
history; and the hit rate each gives on a recorded routing trace (how the cache's policy was chosen: docs/moe.md)."""

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from heapq import nsmallest
from itertools import islice

Key = tuple[int, int]  # (layer, expert)
Trace = list[tuple[int, tuple[int, ...]]]  # (layer, the experts a step chose there), in order


class LRU:
    """Least recently used first."""

    def __init__(self):
        self.last: OrderedDict[Key, None] = OrderedDict()

    def use(self, layer: int, experts: Iterable[int]) -> None:
        for e in experts:
            self.last[(layer, e)] = None
            self.last.move_to_end((layer, e))

    def victims(self, held: set[Key], n: int) -> list[Key]:
        """n of `held` to evict, in order (experts never used since load first)."""
        if n <= 0:
            return []
        out = [k for k in held if k not in self.last][:n]
        return out + list(islice((k for k in self.last if k in held), n - len(out)))


class Frequency(LRU):
    """Least often chosen since the start first (ties: least recently used)."""

    def __init__(self):
        super().__init__()
        self.count: Counter[Key] = Counter()
        self.when: dict[Key, int] = {}  # the step each was last used at
        self.tick = 0

    def use(self, layer: int, experts: Iterable[int]) -> None:
        experts = list(experts)
        self.tick += 1
        self.when.update(((layer, e), self.tick) for e in experts)
        self.count.update((layer, e) for e in experts)

    def victims(self, held: set[Key], n: int) -> list[Key]:
        return nsmallest(max(n, 0), held, key=lambda k: (self.count[k], self.when.get(k, -1)))


class RouterHistory(Frequency):
    """Least often chosen in the layer's last `window` routing steps first (ties: least recently used): frequency
    that forgets, following a conversation's topic."""

    def __init__(self, window: int = 16):
        super().__init__()
        self.window = window
        self.recent: dict[int, deque[tuple[int, ...]]] = {}

    def use(self, layer: int, experts: Iterable[int]) -> None:
        experts = tuple(experts)
        super().use(layer, experts)
        steps = self.recent.setdefault(layer, deque())
        steps.append(experts)
        if len(steps) > self.window:
            self.count.subtract((layer, e) for e in steps.popleft())


POLICIES = {"lru": LRU, "frequency": Frequency, "router-history": RouterHistory}
Policy = LRU | Frequency | RouterHistory


def warm_keys(layers: list[int], n_experts: int) -> list[Key]:
    """The order a cache is filled in at load: experts in turn from every layer."""
    return [(i, e) for e in range(n_experts) for i in layers]


def hit_rate(trace: Trace, layers: list[int], n_experts: int, capacity: int, policy: Policy) -> float:
    """The share of routed experts a cache of `capacity` experts, warmed as at load, finds in memory over `trace`."""
    held = set(warm_keys(layers, n_experts)[:capacity])
    hits = routed = 0
    for layer, experts in trace:
        step = {(layer, e) for e in experts}
        hits += len(step & held)
        routed += len(step)
        held |= step
        policy.use(layer, experts)
        held -= set(policy.victims(held - step, len(held) - max(capacity, len(step))))
    return hits / routed if routed else 0.0
