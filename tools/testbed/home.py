"""A home as a small file describes it: its devices, each with a CPU share, RAM, a disk and a link to the router.

A preset is a JSON file in tools/testbed/presets/ (or any path):
  {"name": "wifi-4", "about": "...",
   "devices": [{"name": "d1", "cpu": 0.45, "cores": [0], "memory": "600MiB", "disk_mbps": 300,
                "latency_ms": 5, "jitter_ms": 0.5, "mbps": 400, "expose": [9000]}, ...]}
cpu: a fraction of one core (the cgroup's quota); cores: optional pinned CPUs; memory: the cgroup's limit, page cache
counted (the node's whole process lives in it); disk_mbps: MB/s of reads (10**6 bytes); latency_ms, jitter_ms: one
way, device to router; mbps: megabits a second each way; expose: extra TCP ports other programs listen on (a hop of
any TCP program between two devices crosses both devices' links).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

PRESETS = Path(__file__).parent / "presets"
MIN_MEMORY = 64 << 20  # below this not even Python starts
UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


class HomeError(ValueError):
    """A home file that cannot be used; the message names the field and the value."""


@dataclass(frozen=True)
class Device:
    name: str
    cpu: float  # cores (a fraction of one, or more)
    memory_bytes: int
    disk_mbps: float  # 10**6 bytes a second
    latency_ms: float  # one way, to the router
    mbps: float  # megabits a second, each way
    jitter_ms: float = 0.0
    cores: tuple[int, ...] = ()
    expose: tuple[int, ...] = ()

    def to_json(self) -> dict:
        return {"name": self.name, "cpu": self.cpu, "memory_bytes": self.memory_bytes, "disk_mbps": self.disk_mbps,
                "latency_ms": self.latency_ms, "jitter_ms": self.jitter_ms, "mbps": self.mbps,
                "cores": list(self.cores), "expose": list(self.expose)}


@dataclass(frozen=True)
class Home:
    name: str
    devices: tuple[Device, ...]
    about: str = ""
    source: str = field(default="", compare=False)


def parse_size(text: str) -> int:
    """'600MiB', '1.5GiB', '2GB' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in UNITS:
        raise ValueError(f"{text!r} is not a size like 600MiB or 2GiB")
    return int(float(m[1]) * UNITS[m[2].lower()])


def _number(d: dict, key: str, where: str, low: float, default: float | None = None) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
        raise HomeError(f"{where}: {key} must be a number >= {low}, got {value!r}")
    return float(value)


def device_from_json(d: dict, where: str) -> Device:
    if not isinstance(d, dict):
        raise HomeError(f"{where}: a device is an object, got {d!r}")
    name = d.get("name")
    if not isinstance(name, str) or not name.isidentifier() or len(name) > 12:
        raise HomeError(f"{where}: name must be a short identifier (letters, digits, _), got {name!r}")
    where = f"{where} ({name})"
    try:
        memory = parse_size(str(d.get("memory", "")))
    except ValueError as exc:
        raise HomeError(f"{where}: memory: {exc}") from None
    if memory < MIN_MEMORY:
        raise HomeError(f"{where}: memory must be at least {MIN_MEMORY >> 20} MiB, got {d.get('memory')!r}")
    cpu = _number(d, "cpu", where, 0.01)
    cores, expose = d.get("cores", []), d.get("expose", [])
    if not isinstance(cores, list) or not all(isinstance(c, int) and c >= 0 for c in cores):
        raise HomeError(f"{where}: cores must be a list of CPU numbers, got {cores!r}")
    if not isinstance(expose, list) or not all(isinstance(p, int) and 0 < p < 65536 for p in expose):
        raise HomeError(f"{where}: expose must be a list of TCP ports, got {expose!r}")
    return Device(name=name, cpu=cpu, memory_bytes=memory, disk_mbps=_number(d, "disk_mbps", where, 1),
                  latency_ms=_number(d, "latency_ms", where, 0), mbps=_number(d, "mbps", where, 0.1),
                  jitter_ms=_number(d, "jitter_ms", where, 0, 0.0), cores=tuple(cores), expose=tuple(expose))


def home_from_json(data: dict, source: str = "") -> Home:
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list) or not data["devices"]:
        raise HomeError(f"{source or 'home'}: needs a non-empty \"devices\" list")
    devices = tuple(device_from_json(d, f"{source} device {i}") for i, d in enumerate(data["devices"]))
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise HomeError(f"{source}: device names repeat: {names}")
    if len(devices) > 200:
        raise HomeError(f"{source}: at most 200 devices, got {len(devices)}")
    return Home(name=str(data.get("name", Path(source).stem)), devices=devices, about=str(data.get("about", "")),
                source=source)


def load_home(preset: str) -> Home:
    """A preset by name (tools/testbed/presets/NAME.json) or a home file by path."""
    path = Path(preset)
    if not path.suffix:
        path = PRESETS / f"{preset}.json"
    if not path.is_file():
        raise HomeError(f"no preset or home file {preset!r}; presets: {', '.join(preset_names())}")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise HomeError(f"{path}: not JSON: {exc}") from None
    return home_from_json(data, str(path))


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.json"))
