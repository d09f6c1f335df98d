"""A device's owner comes first: the limits prima-node is given (--max-cpu, --max-memory, --nice) and the watch that
gives memory back before the OS swaps.

What the device has left is read in two functions, `available_memory` and `memory_pressure`: psutil and Linux PSI
here; a testbed that confines a node to a cgroup points them at the group's limits.
"""

import asyncio
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

PSI = Path("/proc/pressure/memory")
# Give memory back above this share of the last 10 s stalled on memory (PSI "some" avg10, %): prima.cpp's figure for
# a device still usable by its owner is <= 6 % stalled; acting at 5 leaves room.
PSI_HIGH = 5.0
RESERVE = 0.10  # where the OS has no PSI: give memory back when under 10 % of the device's memory is available
SHRINK = 0.75  # each give-back keeps 3/4 of the node's memory budget
MIN_BUDGET = 64 << 20  # and never below this (the node streams every layer by then)
COOLDOWN_S = 10.0  # between two give-backs: the last one's re-plan has to land first
CALM_S = 60.0  # memory given back is taken again after this long without the owner needing it


@dataclass(frozen=True)
class Limits:
    max_cpu: float = 1.0  # share of the cores
    max_memory: int = 0  # bytes, 0: no cap
    nice: bool = False


def available_memory() -> int:
    """Bytes the device's owner and this node could still use now."""
    return psutil.virtual_memory().available


def total_memory() -> int:
    return psutil.virtual_memory().total


def memory_pressure(path: Path = PSI) -> float | None:
    """PSI memory "some" avg10 in % (share of the last 10 s some task stalled on memory); None without PSI."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return parse_psi(text)


def parse_psi(text: str) -> float | None:
    m = re.search(r"^some\b.*?\bavg10=([0-9.]+)", text, re.M)
    return float(m.group(1)) if m else None


def parse_max_memory(text: str, available: int, size: Callable[[str], int]) -> int:
    """--max-memory: a size (2GiB, 512MiB: read by `size`) or a percentage of the memory available now (50%); 0: no
    cap."""
    text = text.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise ValueError(f"--max-memory: {text!r} is not a percentage like 50%") from None
        if not 0 < share <= 100:
            raise ValueError(f"--max-memory: a percentage must be in (0, 100], got {text}")
        return int(available * share / 100)
    return size(text)


def check_max_cpu(fraction: float) -> float:
    if not 0 < fraction <= 1:
        raise ValueError(f"--max-cpu must be a share of the cores in (0, 1], got {fraction}")
    return fraction


def cpu_threads(fraction: float, cores: int) -> int:
    """Compute threads for a share of the cores (at least one)."""
    return max(1, int(cores * fraction + 1e-9))


def profile_cache(name: str, max_cpu: float) -> Path | None:
    """Where a node under --max-cpu keeps its profile: apart from the one measured on all its cores (None: the
    default place)."""
    if max_cpu >= 1:
        return None
    from nodes.profiling.profiler import default_cache_path

    return default_cache_path(f"{name}-cpu{cpu_threads(max_cpu, os.cpu_count() or 1)}")


def limited(profile, max_cpu: float):
    """The profile the planner sees under --max-cpu: it was measured on the node's own threads (cpu_threads), so
    only the share below them is scaled (half a core of a 2-core device: one thread, at half its rate)."""
    from nodes.ring.replan import scaled

    cores = os.cpu_count() or 1
    share = max_cpu * cores / cpu_threads(max_cpu, cores)
    return scaled(profile, 1 / share) if share < 1 - 1e-9 else profile


def budget(*caps: int) -> int:
    """The tightest of the memory caps given (0: none of them caps; then the node's default)."""
    return min((c for c in caps if c > 0), default=0)


def lower_priority() -> list[str]:
    """--nice: the owner's processes win every contest for the CPU. What was done, in words (some may be refused)."""
    done = []
    try:
        os.nice(19 - os.nice(0))
        done.append("nice 19")
    except OSError:
        pass
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            done.append("SCHED_IDLE")
        except OSError:
            pass
    return done


def apply_limits(limits: Limits) -> list[str]:
    """At start, before torch makes its threads: the compute threads of --max-cpu, the priority of --nice."""
    done = []
    if limits.max_cpu < 1:
        import torch

        n = cpu_threads(limits.max_cpu, os.cpu_count() or 1)
        torch.set_num_threads(n)
        done.append(f"{n} compute threads")
    if limits.nice:
        done += lower_priority()
    return done


def needs_memory(pressure: float | None, available: int, total: int) -> bool:
    """The owner needs memory back: stalls past PSI_HIGH where PSI exists, else under RESERVE of it available."""
    if pressure is not None:
        return pressure > PSI_HIGH or available < total * RESERVE / 2
    return available < total * RESERVE


def smaller_budget(current: int, resident: int) -> int:
    """The budget after a give-back: 3/4 of what the node uses now (or of its budget, if smaller)."""
    base = min(b for b in (current, resident) if b > 0) if current > 0 or resident > 0 else 0
    return max(MIN_BUDGET, int(base * SHRINK))


class MemoryWatch:
    """On every node: each second, read the device's memory; when its owner needs memory, drop the prefix cache (at
    once), lower this node's memory budget and ask the head to re-plan (the node's next load streams more layers).
    After CALM_S without the owner needing it, the node lifts its cap and asks for a re-plan again."""

    def __init__(self, node):
        self.node = node
        self.last = -COOLDOWN_S  # the last give-back, or the last second the owner needed memory

    async def round(self) -> None:
        await asyncio.sleep(1.0)
        node = self.node
        if node.shard is None or node.memory_low or time.monotonic() - self.last < COOLDOWN_S:
            return
        if not needs_memory(memory_pressure(), available_memory(), total_memory()):
            if node.memory_cap and time.monotonic() - self.last > CALM_S:  # calm again: take the memory back
                node.memory_cap, node.memory_low = 0, True
                node.log.info("the device's owner no longer needs the memory: asking for a re-plan to use it")
            return
        self.last = time.monotonic()
        shard = node.shard
        dropped = await asyncio.get_running_loop().run_in_executor(node.pool, _drop_prefixes, shard)
        node.memory_cap = smaller_budget(shard.plan.budget or 0, shard.resident_bytes())
        node.memory_low = True
        node.log.warning("the device's owner needs memory: giving some back", prefix_bytes_dropped=dropped,
                         new_budget_mib=node.memory_cap >> 20, pressure=memory_pressure(),
                         available_mib=available_memory() >> 20)


def _drop_prefixes(shard) -> int:
    before = shard.prefixes.nbytes()
    while shard.prefixes.evict_one():
        pass
    return before
