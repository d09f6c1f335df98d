"""Facts of the host a profile reads rather than times: its OS, available RAM by OS rule, its GPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import psutil
import torch

from nodes.engine.memory_room import capped

# ------------------------------------------------------------------ OS


def os_kind(platform: str = sys.platform, environ: Mapping[str, str] = os.environ) -> str:
    """One of prima_rpc.spec.profiles.OS_KINDS; Termux on Android reports "linux" but sets these variables."""
    if platform == "android" or (platform.startswith("linux") and ("TERMUX_VERSION" in environ
                                                                    or "ANDROID_ROOT" in environ)):
        return "android"
    if platform == "darwin":
        return "macos"
    if platform in ("win32", "cygwin"):
        return "windows"
    return "linux"


# ------------------------------------------------------------------ available RAM

_MEMINFO_LINE = re.compile(r"^(\w+(?:\(\w+\))?):\s+(\d+)(?:\s+(kB))?\s*$")
_VM_STAT_PAGE = re.compile(r"page size of (\d+) bytes")
_VM_STAT_LINE = re.compile(r'^"?([^:"]+)"?:\s+(\d+)\.?\s*$')


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes per key ("MemAvailable: 123 kB" -> {"MemAvailable": 125952})."""
    out = {}
    for line in text.splitlines():
        m = _MEMINFO_LINE.match(line.strip())
        if m:
            out[m[1]] = int(m[2]) * (1024 if m[3] else 1)
    return out


def parse_vm_stat(text: str) -> dict[str, int]:
    """macOS `vm_stat` as bytes per key ("Pages free: 1000." -> {"Pages free": 1000 * page size})."""
    page = _VM_STAT_PAGE.search(text)
    if page is None:
        raise ValueError(f"vm_stat output without a page size: {text[:80]!r}")
    size = int(page[1])
    out = {}
    for line in text.splitlines()[1:]:
        m = _VM_STAT_LINE.match(line.strip())
        if m:
            out[m[1].strip()] = int(m[2]) * size
    return out


def ram_rule(kind: str, meminfo: Mapping[str, int] | None = None, vm_stat: Mapping[str, int] | None = None) -> int:
    """Bytes a node may use, by prima.cpp's per-OS rule (inputs in bytes, as the parsers give them).

    linux: MemAvailable; android: MemAvailable + SwapFree (the reclaimable swap Android's zram
    holds); macos: free + inactive + purgeable pages.
    """
    if kind in ("linux", "android"):
        if meminfo is None or "MemAvailable" not in meminfo:
            raise ValueError(f"{kind}: /proc/meminfo has no MemAvailable (kernel < 3.14?)")
        swap = meminfo.get("SwapFree", 0) if kind == "android" else 0
        return meminfo["MemAvailable"] + swap
    if kind == "macos":
        if vm_stat is None or "Pages free" not in vm_stat:
            raise ValueError("macos: vm_stat has no 'Pages free'")
        return vm_stat["Pages free"] + vm_stat.get("Pages inactive", 0) + vm_stat.get("Pages purgeable", 0)
    raise ValueError(f"no RAM rule for os {kind!r}")


def available_ram(kind: str | None = None) -> int:
    """Available RAM of this machine in bytes, by ram_rule (psutil's figure where the rule cannot be read), capped
    by this process's memory control group (a container, a testbed's device)."""
    return capped(_machine_ram(kind))


def _machine_ram(kind: str | None) -> int:
    kind = kind or os_kind()
    vm = psutil.virtual_memory()
    try:
        if kind in ("linux", "android"):
            with open("/proc/meminfo", encoding="ascii") as f:
                return ram_rule(kind, meminfo=parse_meminfo(f.read()))
        if kind == "macos" and shutil.which("vm_stat"):
            text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5, check=True).stdout
            return ram_rule(kind, vm_stat=parse_vm_stat(text))
        if kind == "macos":  # no vm_stat: free + inactive without purgeable
            return vm.free + vm.inactive
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return vm.available


# ------------------------------------------------------------------ GPU


@dataclass(frozen=True)
class GpuInfo:
    kind: str  # prima_rpc.spec.profiles.GPU_KINDS: "cuda" | "metal" | "none"
    device: str | None  # torch device name: "cuda:0", "mps" or None
    name: str = ""
    vram_free: int = 0  # bytes
    vram_total: int = 0  # bytes


def gpu_info() -> GpuInfo:
    """The GPU torch sees (the first CUDA device, else Apple's MPS), with its free memory."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(0)
        return GpuInfo("cuda", "cuda:0", torch.cuda.get_device_name(0), int(free), int(total))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        # Unified memory: Metal may use up to its recommended working set; the caller caps it by free RAM.
        total = int(torch.mps.recommended_max_memory())
        free = max(total - int(torch.mps.driver_allocated_memory()), 0)
        return GpuInfo("metal", "mps", "Apple GPU (Metal)", free, total)
    return GpuInfo("none", None)
