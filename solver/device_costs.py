"""What one device costs per layer, per hop and per byte read: its profile against the model's, for one instance."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace

from prima_rpc.spec.profiles import DeviceProfile
from solver.kv_term import kv_bytes_per_token_layer
from solver.model_profile import ModelProfile

SLOW_DISK = 0.1e9  # B/s; below this prima.cpp forbids offloading (the device must fit, M4)


@dataclass(frozen=True)
class DeviceCosts:
    name: str
    is_head: bool
    routable: bool  # may leave the ring (not head, not in must_stay)
    uma: bool  # Metal: GPU layers share the RAM pool, and macOS evicts all of it when short
    macos: bool
    forced_fit: bool  # disk too slow to offload to
    alpha: float  # s per layer per token on the CPU
    gpu: float  # s per layer per token on the GPU (inf without one)
    hop: float  # s for one activation to its successor
    disk: float  # B/s sequential read
    b: int  # layer bytes
    b_prime: int  # layer bytes + its KV cache
    ram: int  # RAM bytes left for layers (the head's embedding/output taken off)
    ram_layers: int  # floor(ram / b'): layers that fit in RAM
    gpu_cap: int  # layers that fit in VRAM (0 without a GPU)
    serial: float = 0.0  # s per round of compute a streaming turn cannot overlap with its reads
    copy: float = 0.0  # s the compute loses per byte read beside it (profile read_loss_s, else read_cpu_s, else a copy)
    shared_host: bool = False  # another device of the instance runs on its machine: its reads in its gaps slow theirs
    visit: float = 0.0  # s per window visit beyond its layers (profile visit_s): k a token when it holds layers
    cold: float = 0.0  # s more a layer's compute takes when it waited for its read (profile stream_layer_s)
    # a mixture of experts (0: dense): the share of its experts a token routes to (top-k / E); the bytes of a layer
    # but its experts, with its KV cache (always resident); top-k experts' bytes (the least expert cache); and the
    # s per layer of its dense part's compute (attention, router: before its missing experts can be read)
    experts: float = 0.0
    dense_b_prime: int = 0
    step_bytes: int = 0
    dense_alpha: float = 0.0

    @property
    def beta(self) -> float:
        return self.gpu - self.alpha if self.gpu_cap else 0.0


def layer_time(flops: float, nbytes: float, flop_rate: float, bandwidth: float) -> float:
    """Roofline time of one matmul pass: compute or weight reads, whichever is slower."""
    return max(flops / flop_rate, nbytes / bandwidth)


def costs_for(devices: tuple[DeviceProfile, ...], model: ModelProfile, n_ctx: int, must_stay: Collection[str],
              batch: int, kv_dtypes: tuple[str, ...] = ()) -> tuple[DeviceCosts, ...]:
    """Each device's costs (ring order, head first) for `model` with n_ctx tokens of KV cache a layer in its KV
    dtype (kv_dtypes; (): float), batches of `batch` requests; devices in must_stay cannot leave the ring
    (cost_model.Instance holds these)."""
    b = model.layer_bytes_max
    act = model.active_bytes  # what a token's compute reads: all of a dense layer, a mixture's routed part
    out = []
    hosts = [d.host for d in devices]
    for d, kv_dtype in zip(devices, kv_dtypes or ("float",) * len(devices), strict=True):
        kv = kv_bytes_per_token_layer(model, kv_dtype) * n_ctx  # a long context in float: fewer layers fit
        bp = b + kv
        f = d.batch_factor(batch)  # a batch computes in one pass over the weights (1.0 for one request)
        cpu = d.read_cpu_s or 1.0 / d.ram_bandwidth  # CPU s a byte read costs; unmeasured: a copy at RAM speed
        copy = d.read_loss_s or cpu  # what the compute beside it loses per byte (measured: more than the CPU)
        ram = d.ram_available - (model.head_extra_bytes if d.is_head else 0)
        gpu_cap = 0
        gpu = math.inf
        if d.has_gpu:
            gpu = f * layer_time(model.layer_flops, act, d.gpu_flops, d.vram_bandwidth)
            gpu_cap = int(min(d.vram_free, max(ram, 0)) if d.unified_memory else d.vram_free) // bp
        out.append(DeviceCosts(
            name=d.name, is_head=d.is_head, routable=not d.is_head and d.name not in must_stay,
            uma=d.unified_memory, macos=d.os == "macos", forced_fit=d.disk_seq_read < SLOW_DISK,
            alpha=f * layer_time(model.layer_flops, act, d.cpu_flops, d.ram_bandwidth), gpu=gpu,
            hop=d.link_latency_s + model.activation_bytes / d.link_bandwidth + d.frame_s,
            disk=min(d.disk_seq_read, 1.0 / cpu),  # the reader streams no faster than its CPU allows
            b=b, b_prime=bp, ram=ram, ram_layers=ram // bp if ram >= 0 else -1, gpu_cap=gpu_cap,
            serial=f * model.serial_fraction * layer_time(model.layer_flops, act, d.cpu_flops, d.ram_bandwidth),
            copy=copy, shared_host=hosts.count(d.host) > 1 if d.host else False,
            visit=d.visit_s, cold=d.stream_layer_s, experts=model.routed_share, dense_b_prime=model.dense_bytes + kv,
            step_bytes=model.routed_bytes,
            dense_alpha=f * layer_time(model.layer_flops, act, d.cpu_flops, d.ram_bandwidth) * model.dense_bytes / act))
    if batch > 1:  # a batch's frames follow each other on the stream: the latency once, every frame's bytes
        out = [replace(c, hop=c.hop + (batch - 1) * (model.activation_bytes / d.link_bandwidth + d.frame_s))
               for c, d in zip(out, devices)]  # and software cost (nodes send a batch as its frames)
    return tuple(out)
