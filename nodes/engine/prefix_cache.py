"""The prefix cache: a node keeps the KV of recent prompt prefixes for its windows (LRU, inside its KV room), so a
request whose prompt starts with one takes those positions (shared copy-on-write: nodes/engine/kv_share.py) and
prefills only the rest."""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from nodes.engine.kv_share import SharedPrefix, map_prefix, mapped_cache, page_rows, pageable, shareable
from nodes.errors import PrefixMissed

BLOCK = 64  # prefixes are whole blocks of this many prompt tokens: a key per block boundary


def block_keys(ids: list[int], block: int = BLOCK) -> list[str]:
    """keys[j]: the key of ids[:(j + 1) * block], whole blocks only (each chains the one before it)."""
    keys, h = [], hashlib.blake2b(digest_size=16)
    for j in range(len(ids) // block):
        h.update(b"".join(i.to_bytes(4, "little") for i in ids[j * block:(j + 1) * block]))
        keys.append(h.copy().hexdigest())
    return keys


@dataclass(frozen=True)
class Prefix:
    """What a FORWARD frame asks of the prefix cache (the wire's prefix_key ... prefill)."""

    key: str = ""  # its first frame: copy positions [0, length) from the cached prefix `key`
    length: int = 0
    save_key: str = ""  # once positions [0, save_len) are computed, keep their KV under save_key
    save_len: int = 0
    prefill: bool = False  # its rows are prompt positions


NONE = Prefix()


class PrefixCache:
    """Prefixes by key: each layer's k and v of positions [0, length), least recently used first. share: hold them in
    shared memory, mapped copy-on-write into the caches of the requests that take them (nodes/engine/kv_share.py);
    else (or where rows cannot be mapped) copied into each."""

    def __init__(self, share: bool = True):
        self.share = share
        self.entries: OrderedDict[str, dict[int, Held]] = OrderedDict()  # key -> layer -> [2, nkv, L, hd]
        self.users: dict[str, set[str]] = {}  # key -> the requests whose caches map its pages (it stays till they end)

    def __len__(self) -> int:
        return len(self.entries)

    def positions(self) -> int:
        """Positions held, all prefixes together."""
        return sum(_length(kv) for kv in self.entries.values())

    def nbytes(self) -> int:
        return sum(_nbytes(h) for kv in self.entries.values() for h in kv.values())

    def holds(self, key: str, length: int) -> bool:
        entry = self.entries.get(key)
        return entry is not None and _length(entry) >= length

    def rows(self, key: str) -> dict[int, torch.Tensor]:
        """The prefix's tensors by layer (read only)."""
        return {i: _rows(h) for i, h in self.entries[key].items()}

    def take(self, key: str, length: int, cache, request_id: str = "") -> None:
        """Give a request's new cache (a model.KVCache) positions [0, length) of prefix `key`: its pages mapped where
        they are shared (the request is then a user of the prefix until release()), else copied."""
        entry = self.entries.get(key)
        kv = cache.kv
        if entry is None or _length(entry) < length or entry.keys() != kv.keys():
            raise PrefixMissed(f"prefix {key[:12]} of {length} positions is not cached on this node")
        self.entries.move_to_end(key)
        for i, held in entry.items():
            if isinstance(held, SharedPrefix) and kv[i].shape[2] == cache.capacity:  # not a sliding-window ring
                kv[i], shared = mapped_cache(held, kv[i], length)
                cache.shared_bytes += shared
                self.users.setdefault(key, set()).add(request_id)
            else:
                kv[i][:, :, :length] = _rows(held)[:, :, :length]

    def on_pages(self, cache) -> None:
        """Give a new cache that may save a prefix (a prompt from position 0) rows on pages (page_rows), so that it
        can adopt() the saved pages."""
        for i, t in cache.kv.items() if self.share else ():
            if t.shape[2] == cache.capacity and pageable(t):
                cache.kv[i] = page_rows(t)

    def adopt(self, key: str, cache, request_id: str) -> None:
        """The request whose cache the prefix `key` was just saved from gives up its own copy of those positions:
        the saved pages are mapped over them (same bytes; its cache was made with page_rows), so it too holds the
        prefix once."""
        for i, held in self.entries[key].items():
            if isinstance(held, SharedPrefix) and cache.kv[i].shape[2] >= cache.capacity:
                shared = map_prefix(held, cache.kv[i], held.length)
                cache.shared_bytes += shared
                if shared:
                    self.users.setdefault(key, set()).add(request_id)

    def release(self, request_id: str) -> None:
        """The request ended: the prefixes it mapped may be evicted again."""
        for users in self.users.values():
            users.discard(request_id)

    def save(self, key: str, length: int, kv: dict[int, torch.Tensor]) -> None:
        """Keep positions [0, length) of a request's cache under `key` (the caller made room for them)."""
        self.put(key, {i: t[:, :, :length] for i, t in kv.items()})

    def put(self, key: str, rows: dict[int, torch.Tensor]) -> None:
        """Keep `rows` (layer -> [2, nkv, L, hd], copied) under `key`."""
        self._drop(key)
        self.entries[key] = {i: SharedPrefix(t) if self.share and shareable(t) else t.clone() for i, t in rows.items()}

    def evict_one(self) -> bool:
        """Drop the least recently used prefix that no request maps; False if none was."""
        key = next((k for k in self.entries if not self.users.get(k)), None)
        if key is None:
            return False
        self._drop(key)
        return True

    def clear(self) -> None:
        for key in list(self.entries):
            self._drop(key)

    def _drop(self, key: str) -> None:
        for held in self.entries.pop(key, {}).values():
            if isinstance(held, SharedPrefix):
                held.close()
        self.users.pop(key, None)


Held = torch.Tensor | SharedPrefix


def _rows(held: Held) -> torch.Tensor:
    return held.tensor if isinstance(held, SharedPrefix) else held


def _nbytes(held: Held) -> int:
    return held.nbytes() if isinstance(held, SharedPrefix) else held.numel() * held.element_size()


def _length(entry: dict[int, Held]) -> int:
    return _rows(next(iter(entry.values()))).shape[2] if entry else 0
