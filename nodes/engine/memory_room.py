"""The memory this process may still take: what the machine has available, capped by its memory control group.

A node in a container, a cgroup-limited service or a testbed's device sees the machine's MemAvailable, yet the
kernel reclaims and then kills it at its group's limit. The room left is the tightest group on the way up:
its limit less what it holds, the page cache it could drop (inactive files) counted as free.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _groups(proc_cgroup: str) -> list[tuple[Path, bool]]:
    """(this process's memory group directory, is v2) from /proc/self/cgroup's text."""
    out = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():
            out.append((CGROUP_ROOT / rel, True))
        elif "memory" in controllers.split(","):
            out.append((CGROUP_ROOT / "memory" / rel, False))
    return out


def cgroup_room(proc_cgroup: str | None = None) -> int | None:
    """Bytes this process's memory groups still allow (the tightest level), or None where no group limits it."""
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
        groups = _groups(text)
    except (OSError, ValueError):
        return None
    room = None
    for group, v2 in groups:
        level = group
        while level != CGROUP_ROOT.parent and CGROUP_ROOT in (level, *level.parents):
            if v2:
                limit, used = _read_int(level / "memory.max"), _read_int(level / "memory.current")
                cache = _inactive_file(level / "memory.stat", "inactive_file")
            else:
                limit, used = _read_int(level / "memory.limit_in_bytes"), _read_int(level / "memory.usage_in_bytes")
                cache = _inactive_file(level / "memory.stat", "total_inactive_file")
            if limit is not None and limit < UNLIMITED and used is not None:
                left = max(0, limit - used + cache)
                room = left if room is None else min(room, left)
            if level in (CGROUP_ROOT, CGROUP_ROOT / "memory"):
                break
            level = level.parent
    return room


def capped(available: int) -> int:
    """The machine's available bytes, capped by this process's memory groups."""
    room = cgroup_room()
    return available if room is None else min(available, room)


def probe_bytes(nbytes: int, share: int = 4) -> int:
    """A probe's buffer: nbytes, or 1/share of the room this process still has where that is less. A small
    device's profile must fit the device (a 646 MiB one was killed probing an 8B-shaped store)."""
    room = cgroup_room()
    return nbytes if room is None else max(1 << 20, min(nbytes, room // share))


def give_back() -> None:
    """Return freed heap pages to the OS (glibc keeps large freed blocks in its arenas), so the next probe and the
    node's own windows find them in a memory group's room. A no-op elsewhere."""
    gc.collect()  # a probe's shards and caches hold each other in cycles: free them first
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
