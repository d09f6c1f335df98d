"""The head's side of the prefix cache: the prompt prefixes it believes every node holds (nodes keep them:
nodes/engine/prefix_cache.py), and what a new request's frames ask of them. Only whole blocks of prompt tokens
are keyed, never generated ones; a request that waits for a sibling's prefill (n > 1, or two agents with the same
system prompt) shares it. After a restart, or a re-plan that kept its windows, the head finds prefixes on its own
disk and takes the other nodes to hold them too (a node that does not fails the frame, and the head prefills)."""

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from nodes.engine.prefix_cache import BLOCK, Prefix, block_keys


@dataclass(frozen=True)
class PrefixPlan:
    """A request's use of the prefix cache: start from `use_len` cached positions of `use_key`; keep its prompt's
    first `save_len` positions under `save_key`."""

    use_key: str = ""
    use_len: int = 0
    save_key: str = ""
    save_len: int = 0

    def chunk(self, pos: int, n: int, use: bool) -> Prefix:
        """What the prompt chunk of positions [pos, pos + n) asks (use: the cached prefix, on the first chunk)."""
        save = self.save_key and pos < self.save_len <= pos + n
        return Prefix(self.use_key if use else "", self.use_len if use else 0,
                      self.save_key if save else "", self.save_len if save else 0, prefill=True)


COLD = PrefixPlan()


class HeadPrefixes:
    """Prefixes by key (the key of their last block) with the block keys they cover, least recently used first."""

    def __init__(self):
        self.entries: OrderedDict[str, int] = OrderedDict()  # key -> positions
        self.covers: dict[str, str] = {}  # block key -> the entry that covers it
        self.pending: dict[str, asyncio.Future] = {}  # block key -> done when a request in flight has saved it
        self.off_disk: set[str] = set()  # keys on the head's disk that some node lacked: not asked for again
        self.epoch: int | None = None

    def positions(self) -> int:
        return sum(self.entries.values())

    def renew(self, epoch: int) -> None:
        """A new assignment: the nodes dropped their prefixes with their shards."""
        if epoch != self.epoch:
            self.entries.clear()
            self.covers.clear()
            self.off_disk.clear()
            self.epoch = epoch

    def waits_for(self, ids: list[int]) -> asyncio.Future | None:
        """A prefill in flight that would give this prompt more cached positions than the ring holds now."""
        keys, usable = block_keys(ids), (len(ids) - 1) // BLOCK
        have = self._cached_blocks(keys, usable)
        return next((self.pending[k] for k in reversed(keys[have:usable]) if k in self.pending), None)

    def plan(self, ids: list[int], room: int | None, on_disk: Callable[[str], bool] | None = None) -> PrefixPlan:
        """room: positions the ring's tightest node has free beside its requests, this one's included (None: no
        limit). Older prefixes are forgotten to make room for this prompt's, as the nodes will evict them.
        on_disk(key): the head's disk holds prefix `key` of its windows (the others' disks are taken to as well)."""
        keys, usable = block_keys(ids), (len(ids) - 1) // BLOCK
        have = self._cached_blocks(keys, usable)
        if on_disk is not None:
            have = self._from_disk(keys, usable, have, on_disk)
        use_key = self.covers[keys[have - 1]] if have else ""
        if use_key:
            self.entries.move_to_end(use_key)
        save_n = len(keys)
        if save_n <= have or keys[-1] in self.entries or keys[-1] in self.pending or \
                (room is not None and save_n * BLOCK > room):
            return PrefixPlan(use_key, have * BLOCK if use_key else 0)
        self.fit(None if room is None else room - save_n * BLOCK)
        for k in keys[have:]:
            self.pending.setdefault(k, asyncio.get_running_loop().create_future())
        return PrefixPlan(use_key, have * BLOCK if use_key else 0, keys[-1], save_n * BLOCK)

    def settled(self, plan: PrefixPlan, ids: list[int], saved: bool) -> None:
        """The request's prompt went round (saved) or it ended before: wake the requests that wait for it."""
        if not plan.save_key:
            return
        keys = block_keys(ids)[:plan.save_len // BLOCK]
        if saved:
            self.entries[plan.save_key] = plan.save_len
            self.covers.update((k, plan.save_key) for k in keys)
            self.off_disk.discard(plan.save_key)
        for k in keys:
            f = self.pending.pop(k, None)
            if f is not None and not f.done():
                f.set_result(None)

    def missed(self, key: str) -> None:
        """A node did not hold `key` (nor on its disk): forget it."""
        self.off_disk.add(key)
        self.entries.pop(key, None)
        self.covers = {b: e for b, e in self.covers.items() if e != key}

    def fit(self, room: int | None) -> None:
        """Forget the least recently used prefixes until they fit `room` positions, as the nodes evict them."""
        while room is not None and self.entries and self.positions() > max(room, 0):
            self.missed(next(iter(self.entries)))

    def _from_disk(self, keys: list[str], usable: int, have: int, on_disk: Callable[[str], bool]) -> int:
        """Blocks of the prompt the ring may load from disk beyond the `have` it holds (nodes keep a prefix's file
        under the key of its last block, as they did in memory): that prefix is known from now on."""
        for j in range(usable, have, -1):
            key = keys[j - 1]
            if key not in self.off_disk and key not in self.pending and on_disk(key):
                self.entries[key] = j * BLOCK
                self.covers.update((k, key) for k in keys[:j])
                return j
        return have

    def _cached_blocks(self, keys: list[str], usable: int) -> int:
        return next((j for j in range(usable, 0, -1) if keys[j - 1] in self.covers), 0)
