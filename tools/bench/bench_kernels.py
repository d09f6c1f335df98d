"""Decode matmul kernels side by side on SmolLM2's and llama3-8b's matrices: ms per call for M activation rows,
the weight bytes each reads a second, and the memory-bandwidth floor (the weights' bytes over this machine's
measured read bandwidth). Kernels: torch's int4 (`_weight_int4pack_mm_for_cpu`, bfloat16 activations), ours
(nodes/engine/kernels/q4.c, float32 activations as ggml's Q8_0 or two int8 terms, where it
builds), torch's int8 (`_weight_int8pack_mm`,
bfloat16), oneDNN's int8 (`Int8` where its sums are exact) and float32 (`linear`, as the model calls it).
Run it as it is and under `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` for
AVX2. Small matrices are timed in turn over copies of ~64 MB in all, so they are read from memory as in decode.

    python -m tools.bench.bench_kernels [--models smollm2 8b] [--rows 1 16] [--repeats 5] [--threads 2] [--json]
        [--clock cpu]

`--clock cpu` (with --threads 1: the kernels then run on the calling thread) times the thread's CPU time instead of
the wall clock: on a shared machine a kernel's time does not count the spells its thread waited for a core.
"""

import argparse
import json
import math
import time

import torch

from nodes.engine.kernels import q4
from nodes.engine.quant import Int4, Int8, linear, machine_layout, onednn_int8_exact, pack_int4, quantize_int4

SHAPES = {
    "smollm2": {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536),
                "output": (49152, 576)},
    "8b": {"wqkv": (6144, 4096), "wo": (4096, 4096), "w_gate_up": (28672, 4096), "w_down": (4096, 14336)},
}
SPAN = 64 << 20  # bytes of copies a small matrix is timed over


def bandwidth(repeats: int) -> float:
    """Read bandwidth GB/s: the best of `repeats` sums over 512 MB."""
    a = torch.ones(128 << 20)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - start)
    return a.numel() * 4 / best / 1e9


def kernels(n: int, k: int, gen: torch.Generator) -> dict:
    """{name: (weight, activation dtype, bytes read a call)} of one random [N, K] matrix."""
    w = torch.randn(n, k, generator=gen) * 0.02
    q, dm = quantize_int4(w)
    packed = pack_int4(q, machine_layout())
    int4 = 4 * n * k // 8 + n * k // 32 * 4  # values and 2 half-precision (d, m) a group
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) * 1e-3
    out = {"int4 torch bf16": (Int4.from_dm(packed, dm, torch.bfloat16, machine_layout()), torch.bfloat16, int4)}
    if q4.available():
        for mode in q4.MODES:  # activations as ggml's Q8_0, or two int8 terms
            ours = Int4.from_dm(packed, dm, torch.float32, machine_layout())
            ours.mode = q4.MODES[mode]
            out[f"int4 q4.c {mode}"] = (ours, torch.float32, int4)
    small = Int8(q8, scale, torch.bfloat16)
    small.onednn = False
    out["int8 torch bf16"] = (small, torch.bfloat16, n * k)
    if onednn_int8_exact():
        fast = Int8(q8, scale, torch.bfloat16)
        fast.onednn = True
        out["int8 oneDNN bf16"] = (fast, torch.bfloat16, n * k)
    out["float32"] = (w, torch.float32, n * k * 4)
    return out


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_ms(weights: list, x: torch.Tensor, repeats: int, clock=time.perf_counter) -> float:
    """Best of `repeats` passes over the copies, per call."""
    linear(x, weights[0])  # warm-up (oneDNN lays its weights out on first use)
    best = math.inf
    for _ in range(repeats):
        start = clock()
        for w in weights:
            linear(x, w)
        best = min(best, (clock() - start) / len(weights))
    return best * 1e3


def measure(models: list[str], rows: list[int], repeats: int, gbs: float, clock=time.perf_counter) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for model in models:
        for name, (n, k) in SHAPES[model].items():
            found = {kernel: [] for kernel in kernels(64, 64, gen)}
            for _ in range(max(1, SPAN // (n * k * 4))):
                for kernel, entry in kernels(n, k, gen).items():
                    found[kernel].append(entry)
            for m in rows:
                for kernel, entries in found.items():
                    nbytes = entries[0][2]
                    x = torch.randn(m, k, generator=gen).to(entries[0][1])
                    ms = time_ms([e[0] for e in entries], x, repeats, clock)
                    out.append({"model": model, "matrix": f"{name} {n}x{k}", "rows": m, "kernel": kernel, "ms": ms,
                                "gb_s": nbytes / ms / 1e6, "floor_ms": nbytes / gbs / 1e6})
    return out


def table(results: list[dict]) -> str:
    names = list(dict.fromkeys(r["kernel"] for r in results))
    lines = ["| matrix | rows | " + " | ".join(f"{n} ms (GB/s; floor ms)" for n in names) + " |",
             "| --- | ---: |" + " ---: |" * len(names)]
    for key in dict.fromkeys((r["model"], r["matrix"], r["rows"]) for r in results):
        cells = {r["kernel"]: r for r in results if (r["model"], r["matrix"], r["rows"]) == key}
        lines.append(f"| {key[0]} {key[1]} | {key[2]} | " + " | ".join(
            f"{cells[n]['ms']:.3f} ({cells[n]['gb_s']:.0f}; {cells[n]['floor_ms']:.3f})" if n in cells else "-"
            for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--clock", choices=list(CLOCKS), default="wall", help="cpu: the thread's CPU time (--threads 1)")
    args = p.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu times the calling thread only: use it with --threads 1")
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        gbs = bandwidth(args.repeats)
        results = measure(args.models, args.rows, args.repeats, gbs, CLOCKS[args.clock])
    if args.json:
        print(json.dumps({"isa": torch.backends.cpu.get_cpu_capability(), "q4": q4.build(), "bandwidth_gb_s": gbs,
                          "results": results}))
        return
    print(f"ISA {torch.backends.cpu.get_cpu_capability()}, q4.c {q4.build()}, {args.threads} threads, {args.clock}"
          f" clock, read bandwidth {gbs:.1f} GB/s")
    print(table(results))


if __name__ == "__main__":
    main()
