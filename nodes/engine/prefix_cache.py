"""The prefix cache: a node keeps the KV of recent prompt prefixes for its windows (LRU, inside its KV room), so a
request whose prompt starts with one copies those positions and prefills only the rest."""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

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
    """Prefixes by key: each layer's k and v of positions [0, length), least recently used first."""

    def __init__(self):
        self.entries: OrderedDict[str, dict[int, torch.Tensor]] = OrderedDict()  # key -> layer -> [2, nkv, L, hd]

    def __len__(self) -> int:
        return len(self.entries)

    def positions(self) -> int:
        """Positions held, all prefixes together."""
        return sum(_length(kv) for kv in self.entries.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.entries.values() for t in kv.values())

    def take(self, key: str, length: int, kv: dict[int, torch.Tensor]) -> None:
        """Copy positions [0, length) of prefix `key` into a request's cache `kv` (layer -> [2, nkv, S, hd])."""
        entry = self.entries.get(key)
        if entry is None or _length(entry) < length or entry.keys() != kv.keys():
            raise PrefixMissed(f"prefix {key[:12]} of {length} positions is not cached on this node")
        self.entries.move_to_end(key)
        for i, t in entry.items():
            kv[i][:, :, :length] = t[:, :, :length]

    def save(self, key: str, length: int, kv: dict[int, torch.Tensor]) -> None:
        """Keep positions [0, length) of a request's cache under `key` (the caller made room for them)."""
        self.entries[key] = {i: t[:, :, :length].clone() for i, t in kv.items()}
        self.entries.move_to_end(key)

    def evict_one(self) -> bool:
        """Drop the least recently used prefix; False if none was held."""
        if not self.entries:
            return False
        self.entries.popitem(last=False)
        return True

    def clear(self) -> None:
        self.entries.clear()


def _length(entry: dict[int, torch.Tensor]) -> int:
    return next(iter(entry.values())).shape[2] if entry else 0
