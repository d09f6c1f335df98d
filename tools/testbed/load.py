"""An owner's load inside one device's limits: busy processes, or memory touched and held, for a set time.

CPU: the processes join the device's `owner` group, weighted so that while the node computes too the owner gets
FRACTION of the device's quota (and all of it while the node waits). Memory: one process in the device's memory
group touches BYTES and holds them, so the node's page cache and, past the limit, the node itself are squeezed as
an owner's apps squeeze them.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

from tools.testbed import cgroups
from tools.testbed.bed import BedError, read_state

BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"
HOLD = ("import mmap, time\nm = mmap.mmap(-1, {n})\nfor i in range(0, {n}, 4096):\n    m[i] = 1\n"
        "print('holding', {n}, flush=True)\ntime.sleep({s})\n")


def device_groups(base: int, name: str) -> tuple[dict, cgroups.DeviceGroups]:
    state = read_state(base)
    if state is None:
        raise BedError(f"no testbed is up on base port {base} (python -m tools.testbed up PRESET --model DIR)")
    found = [d for d in state["devices"] if d["name"] == name]
    if not found:
        raise BedError(f"no device {name!r}; the devices are {', '.join(d['name'] for d in state['devices'])}")
    if state.get("unlimited"):
        raise BedError(f"this testbed runs without limits ({state['unlimited'][0]}): no device group to load")
    return found[0], cgroups.DeviceGroups(cgroups.Tree.detect(), found[0]["group"])


def run_load(base: int, name: str, seconds: float, cpu: float | None = None, memory: int | None = None,
             wait: bool = True) -> list[subprocess.Popen]:
    """Start the load; with wait, return once it has run `seconds`."""
    if (cpu is None) == (memory is None):
        raise BedError("give one of --cpu FRACTION or --memory BYTES")
    if not 0 < seconds <= 24 * 3600:
        raise BedError(f"--seconds must be in (0, 86400], got {seconds}")
    device, groups = device_groups(base, name)
    if cpu is not None:
        if not 0 < cpu < 1:
            raise BedError(f"--cpu is the owner's fraction of the device's share, in (0, 1), got {cpu}")
        groups.set_owner_share(cpu)
        codes = [BUSY.format(s=seconds)] * max(1, math.ceil(device["cpu"]))
        role = "owner"
    else:
        if not 0 < memory <= device["memory_bytes"] * 4:
            raise BedError(f"--memory must be in (0, {device['memory_bytes'] * 4}] bytes, got {memory}")
        codes, role = [HOLD.format(n=memory, s=seconds)], "owner"

    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                              preexec_fn=lambda: groups.join(os.getpid(), role)) for code in codes]
    if wait:
        deadline = time.monotonic() + seconds + 30
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    return procs
