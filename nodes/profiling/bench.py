"""Timed probes of compute and memory: matmul FLOP/s per dtype and device, memory read bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nodes.engine.memory_room import probe_bytes

HIDDEN = 2048  # a small model's hidden size: the weight of one projection is [HIDDEN, HIDDEN]
GEMV_BYTES = 128 << 20  # weights cycled by the GEMV probe: beyond any last-level cache, as in decode
PREFILL_TOKENS = 256  # rows of the GEMM probe (a prefill chunk)
BANDWIDTH_BYTES = 256 << 20  # the buffer the bandwidth probe reads
BATCHES = 5  # timed batches per probe; the median is reported
BATCH_S = 0.06  # least seconds per batch
PROBE_S = 0.4  # no new batch starts after this (a slow dtype's step can outlast a batch)


@dataclass(frozen=True)
class MatmulRates:
    """FLOP/s of one dtype on one device; decode sees `gemv`, prefill sees `gemm`."""

    dtype: str
    device: str
    gemv: float  # x [1, H] @ W.T over GEMV_BYTES of distinct weights: bound by weight reads, as decode is
    gemm: float  # x [PREFILL_TOKENS, H] @ W.T on one weight: bound by arithmetic


def _sync(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    if device == "mps":
        return torch.mps.synchronize
    return lambda: None


def _median_rate(step: Callable[[], None], work: float, device: str) -> float:
    """Median over <= BATCHES of work units per second; each batch repeats `step` for >= BATCH_S."""
    sync = _sync(device)
    step()  # warm-up: kernel selection, first-touch page faults
    sync()
    rates: list[float] = []
    probe_start = time.perf_counter()
    while len(rates) < BATCHES and (not rates or time.perf_counter() - probe_start < PROBE_S):
        n, start = 0, time.perf_counter()
        while True:
            step()
            n += 1
            if n % 4 == 0 or n < 4:  # sync (costly on a GPU) every few steps only
                sync()
                elapsed = time.perf_counter() - start
                if elapsed >= BATCH_S:
                    break
        rates.append(n * work / elapsed)
    return statistics.median(rates)


def measure_matmul_flops(dtype: str = "float32", device: str = "cpu") -> MatmulRates:
    """Matmul FLOP/s of `dtype` ("float32", "bfloat16", "float16") on a torch device ("cpu", "cuda:0", "mps")."""
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"not a floating-point torch dtype: {dtype!r}")
    per_weight = HIDDEN * HIDDEN * dt.itemsize
    with torch.inference_mode():
        # Constant, well-scaled values: no denormals, no NaN from uninitialised memory.
        weights = [torch.full((HIDDEN, HIDDEN), 0.01, dtype=dt, device=device)
                   for _ in range(max(probe_bytes(GEMV_BYTES) // per_weight, 1))]
        x1 = torch.full((1, HIDDEN), 0.5, dtype=dt, device=device)
        xp = torch.full((PREFILL_TOKENS, HIDDEN), 0.5, dtype=dt, device=device)

        turn = iter(range(1 << 62))

        def gemv() -> None:  # one projection per step, cycling: each weight is cold again when its turn comes
            torch.nn.functional.linear(x1, weights[next(turn) % len(weights)])

        def gemm() -> None:
            torch.nn.functional.linear(xp, weights[0])

        gemv_rate = _median_rate(gemv, 2.0 * HIDDEN * HIDDEN, device)
        gemm_rate = _median_rate(gemm, 2.0 * PREFILL_TOKENS * HIDDEN * HIDDEN, device)
    return MatmulRates(dtype, device, gemv_rate, gemm_rate)


def measure_memory_bandwidth(device: str = "cpu") -> float:
    """Read bandwidth in B/s: summing a BANDWIDTH_BYTES float32 buffer that no cache holds."""
    with torch.inference_mode():
        nbytes = probe_bytes(BANDWIDTH_BYTES) if device == "cpu" else BANDWIDTH_BYTES
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        return _median_rate(lambda: buf.sum(), float(nbytes), device)
