"""Network namespaces of a testbed: each device's node sees only its own loopback, so every byte it sends to
another device goes through the link shaper (tools/testbed/shaper.py). Made with iproute2's `ip netns`; a process
enters one with setns(2), which leaves its mount namespace (and so /sys/fs/cgroup) as it is."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000


class NetnsError(RuntimeError):
    pass


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def create(name: str) -> None:
    if not (NETNS_DIR / name).exists():
        _ip("netns", "add", name)
    _ip("-n", name, "link", "set", "lo", "up")


def delete(name: str) -> None:
    if (NETNS_DIR / name).exists():
        _ip("netns", "del", name)


def names(prefix: str) -> list[str]:
    return sorted(p.name for p in NETNS_DIR.glob(f"{prefix}*")) if NETNS_DIR.is_dir() else []


def enter(name: str) -> None:
    """Move the calling thread (the whole process, if it has one thread) into namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise NetnsError(f"setns({name}): {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def usable() -> str | None:
    """None where namespaces can be made here, else why not."""
    try:
        create("prima-tb-probe")
        delete("prima-tb-probe")
    except (NetnsError, OSError) as exc:
        return f"network namespaces: {exc}"
    return None
