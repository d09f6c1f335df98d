"""Random device clusters for tests and the solver benchmark: plausible home devices, and tiny instances."""

from __future__ import annotations

import random
from dataclasses import replace

from prima_rpc.spec.profiles import DeviceProfile
from solver.cost_model import Instance
from solver.model_profile import ModelProfile

GiB = 2**30

# kind -> (os, gpu_kind, cpu GFLOP/s, gpu TFLOP/s, RAM GB/s, VRAM GB/s, RAM GiB, VRAM GiB, disk GB/s)
KINDS = {
    "phone": ("android", "none", (30, 100), (0, 0), (15, 40), (0, 0), (1.5, 6), (0, 0), (0.8, 2.0)),
    "laptop": ("linux", "none", (150, 400), (0, 0), (25, 50), (0, 0), (3, 14), (0, 0), (1.0, 3.5)),
    "gpu-laptop": ("linux", "cuda", (200, 500), (5, 15), (30, 50), (250, 450), (3, 14), (4, 8), (1.5, 3.5)),
    "desktop": ("linux", "cuda", (300, 800), (10, 40), (35, 70), (400, 1000), (6, 28), (8, 24), (2.0, 7.0)),
    "mac": ("macos", "metal", (100, 400), (2, 10), (60, 200), (60, 200), (2, 12), (0, 0), (0.7, 3.0)),
    "windows": ("windows", "cuda", (200, 600), (5, 20), (30, 60), (250, 700), (4, 16), (4, 12), (0.05, 3.0)),
}


def random_device(rng: random.Random, name: str, kind: str | None = None, is_head: bool = False) -> DeviceProfile:
    kind = kind or rng.choice(sorted(KINDS))
    os_, gpu_kind, cpu, gpu, rbw, vbw, ram, vram, disk = KINDS[kind]

    def u(lo_hi: tuple[float, float]) -> float:
        return rng.uniform(*lo_hi)

    ram_b = int(u(ram) * GiB)
    vram_b = ram_b if gpu_kind == "metal" else int(u(vram) * GiB)
    ram_bw = u(rbw) * 1e9
    return DeviceProfile(
        name=name, os=os_, cpu_flops=u(cpu) * 1e9, gpu_flops=u(gpu) * 1e12, gpu_kind=gpu_kind,
        ram_bandwidth=ram_bw, vram_bandwidth=ram_bw if gpu_kind == "metal" else u(vbw) * 1e9,
        disk_seq_read=u(disk) * 1e9, disk_rand_read=u(disk) * 0.4e9, ram_available=ram_b, vram_free=vram_b,
        link_latency_s=rng.uniform(0.002, 0.008), link_bandwidth=rng.uniform(200, 800) * 1e6 / 8,
        is_head=is_head)


def random_devices(count: int, seed: int = 0) -> tuple[DeviceProfile, ...]:
    rng = random.Random(seed)
    return tuple(random_device(rng, f"dev{i:02d}", is_head=i == 0) for i in range(count))


N_CTX = 256  # KV context of the tiny instances


def small_instance(seed: int, L: int | None = None, max_devices: int = 4) -> Instance:
    """Tiny model and 1-4 devices with memory drawn in layer units, so every regime shows up:
    fits, offloads to disk (M1/M2/M3), slow disks forced to fit, Metal unified memory, VRAM caps,
    relays. Small enough for exhaustive search."""
    rng = random.Random(seed)
    L = L or rng.choice([4, 6, 8, 12, 16])
    model = ModelProfile.from_dims(hidden=256, intermediate=688, n_layers=L, n_heads=4, n_kv_heads=2,
                                   vocab=1000, max_seq_len=N_CTX)
    bp = model.layer_bytes_max + model.kv_bytes_per_token_layer * N_CTX
    devs = []
    for i in range(rng.randint(1, max_devices)):
        kind = rng.choice(["cpu", "cuda", "metal", "android"])
        os_ = {"cpu": rng.choice(["linux", "macos"]), "cuda": rng.choice(["linux", "windows"]),
               "metal": "macos", "android": "android"}[kind]
        ram = int(rng.randint(0, L) * bp + rng.random() * bp + (model.head_extra_bytes if i == 0 else 0))
        gpu = kind in ("cuda", "metal")
        vram = ram if kind == "metal" else (rng.randint(0, L) * bp + int(rng.random() * bp) if gpu else 0)
        rbw = 10 ** rng.uniform(8.5, 10.5)
        vbw = (rbw if kind == "metal" else 10 ** rng.uniform(10, 11.5)) if gpu else 0.0
        devs.append(DeviceProfile(
            name=f"d{i}", os=os_, cpu_flops=10 ** rng.uniform(9, 11),
            gpu_flops=10 ** rng.uniform(10, 12.5) if gpu else 0.0, gpu_kind=kind if gpu else "none",
            ram_bandwidth=rbw, vram_bandwidth=vbw,
            disk_seq_read=rng.choice([0.05e9, 10 ** rng.uniform(8.3, 9.7)]), disk_rand_read=1e8,
            ram_available=ram, vram_free=vram, link_latency_s=10 ** rng.uniform(-4.5, -2.5),
            link_bandwidth=10 ** rng.uniform(6.5, 8.5), is_head=i == 0))
    must = frozenset(d.name for d in devs[1:] if rng.random() < 0.2)
    return Instance(tuple(devs), model, n_ctx=N_CTX, must_stay=must)


def starved_devices(count: int, seed: int = 0) -> tuple[DeviceProfile, ...]:
    """Phones, laptops and Macs only: a 70B model must offload to disk somewhere."""
    rng = random.Random(seed)
    return tuple(random_device(rng, f"dev{i:02d}", kind=rng.choice(["phone", "laptop", "mac"]), is_head=i == 0)
                 for i in range(count))


VARIED = ("cpu_flops", "gpu_flops", "ram_bandwidth", "vram_bandwidth", "disk_seq_read", "disk_rand_read",
          "ram_available", "vram_free", "link_latency_s", "link_bandwidth")


def cycled_devices(base: tuple[DeviceProfile, ...], count: int, seed: int = 0,
                   spread: float = 0.3) -> tuple[DeviceProfile, ...]:
    """count devices cycling through base (e.g. prima.cpp's D1-D4), each figure varied by +-spread;
    a Metal device's VRAM stays its RAM (unified memory)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        d = base[i % len(base)]
        vary = {f: type(getattr(d, f))(getattr(d, f) * rng.uniform(1 - spread, 1 + spread)) for f in VARIED}
        if d.unified_memory:
            vary["vram_free"] = vary["ram_available"]
        out.append(replace(d, name=f"{d.name}-{i:02d}", is_head=i == 0, **vary))
    return tuple(out)
