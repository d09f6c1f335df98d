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
       "host": "3f2a...",               # optional (""): the machine; devices with the same host share its CPU
       "batch_cost": {"1": 1.0, "2": 1.1, "4": 1.4, "8": 2.1},
                                        # optional: a decode step of b requests at once (one pass over the
                                        #   weights, attention per request) / one request's, per layer;
                                        #   missing: b (no gain assumed, see DeviceProfile.batch_factor)
       "output_batch_cost": {"1": 1.0, "8": 1.4},   # optional: the same for the model's output layer (the
                                        #   head's, one pass for the batch's rows; missing: b)
       "visit_s": 0.0004,               # optional (0): a window visit's cost beyond its layers' (the ring
                                        #   comes back to the node's window with its caches gone cold)
       "read_cpu_s": 4e-10,             # optional (0: 1 / ram_bandwidth, a copy): CPU seconds a byte its
                                        #   prefetcher reads costs (the read, the copy into its buffer)
       "read_loss_s": 5e-10,            # optional (0: read_cpu_s): compute seconds a node loses per byte a
                                        #   reader streams beside it (more than the reader's CPU)
       "stream_layer_s": 0.0008,        # optional (0): a streamed layer's compute beyond a resident one's
                                        #   (it starts cold, after waiting for its read)
       "is_head": true},                # optional; must be true exactly for the first device
      ...]}

Any top-level key starting with "_" (e.g. "_source") is a note and is ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

KV_CHOICES = ("auto", "float", "int8", "int4")  # a device's KV dtype (nodes/engine/kv_dtype.py CHOICES)

OS_KINDS = ("linux", "macos", "android", "windows")
GPU_KINDS = ("cuda", "metal", "none")
OPTIONAL = ("frame_s", "token_s", "output_s", "visit_s", "read_cpu_s", "read_loss_s", "stream_layer_s", "is_head",
            "host", "batch_cost", "output_batch_cost", "kv_dtype")


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
    read_cpu_s: float = 0.0
    read_loss_s: float = 0.0
    stream_layer_s: float = 0.0
    is_head: bool = False
    host: str = ""
    batch_cost: tuple[tuple[int, float], ...] = ()  # (b, cost of b rows / cost of 1 row), b ascending, from 1
    output_batch_cost: tuple[tuple[int, float], ...] = ()  # the same for the output layer
    kv_dtype: str = "auto"  # its node's --kv-dtype: float | int8 | int4, or auto (the plan chooses)

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
            if f.name in ("name", "os", "gpu_kind", "is_head", "host", "batch_cost", "output_batch_cost", "kv_dtype"):
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
        if self.kv_dtype not in KV_CHOICES:
            raise ValueError(f"{self.name}: kv_dtype must be one of {KV_CHOICES}, got {self.kv_dtype!r}")
        if not isinstance(self.host, str):
            raise ValueError(f"{self.name}: host must be a string, got {self.host!r}")
        for key in ("batch_cost", "output_batch_cost"):
            object.__setattr__(self, key, _batch_cost(f"{self.name}: {key}", getattr(self, key)))

    @property
    def has_gpu(self) -> bool:
        return self.gpu_kind != "none" and self.gpu_flops > 0

    @property
    def unified_memory(self) -> bool:
        # Apple Silicon with Metal: GPU layers live in the same RAM pool.
        return self.gpu_kind == "metal" and self.gpu_flops > 0

    def batch_factor(self, b: int) -> float:
        """Cost of a decode step of b requests computed together over one of one request (per layer).

        Between measured sizes: linear; past the largest: its last segment's slope per row. No curve (a profile
        from before batches were measured): b, i.e. no gain from batching. That is the conservative choice (a
        plan never promises a throughput that depends on a gain nobody measured) and it equals what a node that
        computes requests one at a time costs; re-profiling measures the curve."""
        return _interpolate(self.batch_cost, b)

    def output_batch_factor(self, b: int) -> float:
        """The same for the output layer (its own curve: one large matrix scales unlike a layer's small ones)."""
        return _interpolate(self.output_batch_cost, b)

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
        out = asdict(self)
        for key in ("batch_cost", "output_batch_cost"):
            out[key] = {str(b): c for b, c in getattr(self, key)}
        return out


def _interpolate(pts: tuple[tuple[int, float], ...], b: int) -> float:
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise ValueError(f"batch size must be an int >= 1, got {b!r}")
    if len(pts) < 2:
        return float(b)
    for (b0, c0), (b1, c1) in zip(pts, pts[1:]):
        if b <= b1:
            return c0 + (c1 - c0) * (b - b0) / (b1 - b0)
    (b0, c0), (b1, c1) = pts[-2], pts[-1]
    return c1 + max(c1 - c0, 0.0) / (b1 - b0) * (b - b1)


def _batch_cost(name: str, raw) -> tuple[tuple[int, float], ...]:
    """A batch cost curve from JSON ({"1": 1.0, "2": 1.1, ...}) or pairs, checked: sizes ints >= 1 including 1 at
    cost 1.0 (it is relative to one row), costs finite and > 0."""
    items = raw.items() if isinstance(raw, dict) else raw
    try:
        pts = sorted((int(b), c) for b, c in items)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must map batch sizes to costs, got {raw!r}") from None
    if not pts:
        return ()
    for b, c in pts:
        if b < 1 or isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
            raise ValueError(f"{name} needs sizes >= 1 and costs > 0, got {b!r}: {c!r}")
    if pts[0] != (1, 1.0) or len({b for b, _ in pts}) != len(pts):
        raise ValueError(f"{name} must hold size 1 at cost 1.0 once (costs are relative to one row), "
                         f"got {raw!r}")
    return tuple((b, float(c)) for b, c in pts)


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
