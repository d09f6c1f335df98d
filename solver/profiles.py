"""Device profiles: what one machine of the ring can do, as plain data loaded from JSON.

JSON schema (plain JSON, keys = field names, SI units):

    {"devices": [                       # ring order; the first device is the head (rank 0)
      {"name": "D1",                    # unique, non-empty
       "os": "macos",                   # linux | macos | android | windows
       "cpu_flops": 2.0e11,             # FLOP/s of the CPU for the compute dtype
       "gpu_flops": 2.0e12,             # FLOP/s of the GPU, 0 if none
       "gpu_kind": "metal",             # cuda | metal | none ("metal" = unified memory)
       "ram_bandwidth": 6.0e10,         # B/s, RAM read
       "vram_bandwidth": 6.0e10,        # B/s, VRAM read (0 if no GPU)
       "disk_seq_read": 2.0e9,          # B/s
       "disk_rand_read": 7.2e8,         # B/s
       "ram_available": 2576980377,     # bytes the node may use in RAM
       "vram_free": 2576980377,         # bytes free on the GPU (Metal: part of ram_available)
       "link_latency_s": 0.005,         # one hop to its successor in the ring, seconds
       "link_bandwidth": 5.0e7,         # B/s of that hop
       "frame_s": 0.0002,               # optional (0): software cost of a hop here, frame in and out
       "token_s": 0.0001,               # optional (0): the head's own work per token here (hand-offs of the
                                        #   embedding and logits, sampling, detokenising, the token's event)
       "output_s": 0.008,               # optional (0: from the roofline): the model's output layer here
       "visit_s": 0.0004,               # optional (0): a window visit's cost beyond its layers' (the ring
                                        #   comes back to the node's window with its caches gone cold)
       "is_head": true},                # optional; must be true exactly for the first device
      ...]}

Any top-level key starting with "_" (e.g. "_source") is a note and is ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

OS_KINDS = ("linux", "macos", "android", "windows")
GPU_KINDS = ("cuda", "metal", "none")
OPTIONAL = ("frame_s", "token_s", "output_s", "visit_s", "is_head")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    os: str
    cpu_flops: float
    gpu_flops: float
    gpu_kind: str
    ram_bandwidth: float
    vram_bandwidth: float
    disk_seq_read: float
    disk_rand_read: float
    ram_available: int
    vram_free: int
    link_latency_s: float
    link_bandwidth: float
    frame_s: float = 0.0
    token_s: float = 0.0
    output_s: float = 0.0
    visit_s: float = 0.0
    is_head: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"device name must be a non-empty string, got {self.name!r}")
        if self.os not in OS_KINDS:
            raise ValueError(f"{self.name}: os must be one of {OS_KINDS}, got {self.os!r}")
        if self.gpu_kind not in GPU_KINDS:
            raise ValueError(f"{self.name}: gpu_kind must be one of {GPU_KINDS}, got {self.gpu_kind!r}")
        if self.gpu_kind == "metal" and self.os != "macos":
            raise ValueError(f"{self.name}: gpu_kind 'metal' needs os 'macos', got {self.os!r}")
        for f in fields(self):
            if f.name in ("name", "os", "gpu_kind", "is_head"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{self.name}: {f.name} must be a finite number >= 0, got {v!r}")
        for key in ("cpu_flops", "ram_bandwidth", "disk_seq_read", "link_bandwidth"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{self.name}: {key} must be > 0, got {getattr(self, key)!r}")
        if self.has_gpu and self.vram_bandwidth <= 0:
            raise ValueError(f"{self.name}: a {self.gpu_kind} GPU needs vram_bandwidth > 0")
        for key in ("ram_available", "vram_free"):  # JSON may spell byte counts as 2.4e9
            object.__setattr__(self, key, int(getattr(self, key)))
        if not isinstance(self.is_head, bool):
            raise ValueError(f"{self.name}: is_head must be a bool, got {self.is_head!r}")

    @property
    def has_gpu(self) -> bool:
        return self.gpu_kind != "none" and self.gpu_flops > 0

    @property
    def unified_memory(self) -> bool:
        # Apple Silicon with Metal: GPU layers live in the same RAM pool.
        return self.gpu_kind == "metal" and self.gpu_flops > 0

    @classmethod
    def from_json(cls, obj: dict) -> DeviceProfile:
        if not isinstance(obj, dict):
            raise ValueError(f"a device must be a JSON object, got {type(obj).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - names)
        missing = sorted(n for n in names - set(obj) if n not in OPTIONAL)
        if unknown:
            raise ValueError(f"device {obj.get('name')!r}: unknown keys {unknown}")
        if missing:
            raise ValueError(f"device {obj.get('name')!r}: missing keys {missing}")
        return cls(**obj)

    def to_json(self) -> dict:
        return asdict(self)


def devices_from_json(obj: dict) -> tuple[DeviceProfile, ...]:
    """Parse a profiles document; the first device is the head."""
    if not isinstance(obj, dict) or not isinstance(obj.get("devices"), list):
        raise ValueError('a profiles file must be {"devices": [ {...}, ... ]}')
    unknown = sorted(k for k in obj if k != "devices" and not k.startswith("_"))
    if unknown:
        raise ValueError(f"profiles: unknown top-level keys {unknown}")
    raw = obj["devices"]
    if not raw:
        raise ValueError("profiles: the device list is empty")
    devs = []
    for i, d in enumerate(raw):
        if isinstance(d, dict) and "is_head" not in d:
            d = {**d, "is_head": i == 0}
        devs.append(DeviceProfile.from_json(d))
    heads = [d.name for d in devs if d.is_head]
    if heads != [devs[0].name]:
        raise ValueError(f"profiles: exactly the first device must be the head, got heads {heads}")
    names = [d.name for d in devs]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"profiles: duplicate device names {dups}")
    return tuple(devs)


def devices_to_json(devices: tuple[DeviceProfile, ...] | list[DeviceProfile]) -> dict:
    return {"devices": [d.to_json() for d in devices]}


def load_profiles(path: Path | str) -> tuple[DeviceProfile, ...]:
    with open(path, encoding="utf-8") as f:
        return devices_from_json(json.load(f))
