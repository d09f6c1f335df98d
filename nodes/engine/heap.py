"""Giving freed heap memory back to the system after a node replaces its layers.

glibc gives each thread that allocates an arena of its own and keeps what is freed there for reuse. A node loads
its windows on its compute thread, so the old windows' tensors, freed at a re-plan, stayed in the process: five
SmolLM2 window sets loaded one after the other on a worker thread held 445 MiB anonymous after the last was
dropped, 156 MiB once trimmed (tools/bench/chaos.py found the growth: +290 % across 8 faults)."""

import ctypes
import ctypes.util

_LIBC = ctypes.util.find_library("c")


def give_back() -> None:
    """malloc_trim(0): return every arena's free pages (glibc only; elsewhere a no-op)."""
    try:
        trim = ctypes.CDLL(_LIBC).malloc_trim if _LIBC else None
    except (OSError, AttributeError):  # not glibc: musl, macOS
        return
    if trim is not None:
        trim(0)
