"""int8 matmul kernels side by side on llama3-8b's matrices (and SmolLM2's output): torch's bfloat16 kernel
(`_weight_int8pack_mm`, weights widened to float) vs `Int8.mm` (oneDNN u8 x s8 with activations quantized per
row; what nodes/engine/quant.py runs for large matrices), at 1, 4 and 8 rows, 2 threads, interleaved; best of
--repeats, as ms per call and GB/s of int8 weights read.

    python -m tools.bench.bench_int8 [--rows 1 4 8] [--repeats 7] [--json]
"""

import argparse
import json
import time

import torch

from nodes.engine.quant import Int8

BASE = "int8pack bf16"
SHAPES = {"wqkv 6144x4096": (6144, 4096), "wo 4096x4096": (4096, 4096), "w_gate_up 28672x4096": (28672, 4096),
          "w_down 4096x14336": (4096, 14336), "SmolLM2 output 49152x576": (49152, 576)}


def best_ms(f, calls: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    out = []
    for name, (n, k) in SHAPES.items():
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        scale = (torch.rand(n, generator=g) * 1e-3 + 1e-4).bfloat16()
        fast = Int8(q, scale, torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            kernels = {"int8pack bf16": lambda x=x, q=q, scale=scale: torch.ops.aten._weight_int8pack_mm(x, q, scale),
                       "oneDNN u8s8": lambda x=x, fast=fast: fast.mm(x)}
            ms = {kernel: float("inf") for kernel in kernels}
            for f in kernels.values():
                f()  # warm-up (oneDNN packs its weights on first use)
            for _ in range(args.repeats):
                for kernel, f in kernels.items():
                    ms[kernel] = min(ms[kernel], best_ms(f))
            exact = x.float() @ (q.float() * scale.float()[:, None]).t()
            for kernel, f in kernels.items():
                err = ((f().float() - exact).abs().max() / exact.abs().max()).item()
                out.append({"matrix": name, "rows": m, "kernel": kernel, "ms": ms[kernel],
                            "gb_s": n * k / ms[kernel] / 1e6, "rel_err": err})
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'matrix':26} {'rows':>4} {'kernel':14} {'ms':>8} {'GB/s':>6} {'max err / max':>13} {'speed-up':>8}")
    for r in out:
        base = next(b for b in out if (b["matrix"], b["rows"], b["kernel"]) == (r["matrix"], r["rows"], BASE))
        print(f"{r['matrix']:26} {r['rows']:4} {r['kernel']:14} {r['ms']:8.3f} {r['gb_s']:6.1f} {r['rel_err']:13.4f} "
              f"{base['ms'] / r['ms']:7.2f}x")


if __name__ == "__main__":
    main()
