"""q4.c as a decode step meets it: every matrix of a model's layers called once a pass, one activation row, so each
weight comes from memory, not the cache (bench_kernels repeats one matrix, which then lives in the cache). Side by
side with q4.c as it was at a git revision, built with the same flags, interleaved in one process:

    python -m tools.bench.bench_stream [--rev HEAD~1] [--model smollm2|8b] [--layers 30] [--passes 30] [--threads 1]

Both builds must give the same outputs (checked first): bit for bit where they keep the weights in the same layout,
else within float32's rounding of the sums (a tiled build sums a group's products in another order).
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from nodes.engine.kernels import build

MODELS = {  # a layer's matrices (wqkv, wo, w_gate_up, w_down) and the output head, int8
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
    "8b": ([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], (49152, 4096)),  # llama3-8b's shapes
}
TILE_BYTES = 160  # q4.c's tiled builds: a tile's group
MODES = {"exact": 0, "q8": 1}


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.tile = lib.prima_q4_tiles() if hasattr(lib, "prima_q4_tiles") else 0  # a revision before tiles: rows
    for fn in (lib.prima_int8_mm, *([] if lib.tile else [lib.prima_q4_mm])):
        fn.argtypes = [p] * 4 + [i] * 3 + [ctypes.c_int] * 2
        fn.restype = ctypes.c_int
    if lib.tile:
        lib.prima_q4_tile.argtypes = [p] * 3 + [i] * 2 + [ctypes.c_int]
        lib.prima_q4_tiled_mm.argtypes = [p] * 3 + [i] * 3 + [ctypes.c_int] * 2
    lib.int8_tile = lib.tile if hasattr(lib, "prima_int8_tile") else 0
    if lib.int8_tile:
        lib.prima_int8_tile.argtypes = [p] * 2 + [i] * 2 + [ctypes.c_int]
        lib.prima_int8_tiled_mm.argtypes = [p] * 4 + [i] * 3 + [ctypes.c_int] * 2
    return lib


def compiled(source: bytes, flags: tuple[str, ...], out: Path) -> Path:
    src = out.with_suffix(".c")
    src.write_bytes(source)
    subprocess.run([build.compiler(), *build.COMMON, *flags, f"-I{build.HERE}", str(src), "-o", str(out), "-lm"],
                   check=True)  # -I: the kernels' shared header (cpu_ok.h) for a source copied out of the tree
    return out


class Weights:
    def __init__(self, model: str, layers: int):
        g = torch.Generator().manual_seed(0)
        shapes, self.shape = MODELS[model]
        self.int4 = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                      torch.randn(n, 2, k // 32, generator=g).half()) for _ in range(layers) for n, k in shapes]
        n, k = self.shape
        self.int8 = (torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g))
        self.x = {k: torch.randn(1, k, generator=g) for k in {k for _, k in shapes} | {k}}
        self.tiled: list[torch.Tensor] = []
        self.int8_tiles: torch.Tensor | None = None

    def tile(self, lib: ctypes.CDLL) -> None:
        """The int4 weights in a tiled build's layout too (made once)."""
        if lib.tile and not self.tiled:
            for q, dm in self.int4:
                n, k = q.shape[0], q.shape[1] * 2
                t = torch.empty(-(-n // lib.tile), k // 32, TILE_BYTES, dtype=torch.uint8)
                lib.prima_q4_tile(q.data_ptr(), dm.data_ptr(), t.data_ptr(), n, k, torch.get_num_threads())
                self.tiled.append(t)
        if lib.int8_tile and self.int8_tiles is None:
            (w, _), (n, k) = self.int8, self.shape
            self.int8_tiles = torch.empty(-(-n // lib.tile), k // 32, lib.tile * 32, dtype=torch.int8)
            lib.prima_int8_tile(w.data_ptr(), self.int8_tiles.data_ptr(), n, k, torch.get_num_threads())

    def layers(self, lib: ctypes.CDLL, mode: int, threads: int) -> list[torch.Tensor]:
        ys = []
        for i, (q, dm) in enumerate(self.int4):
            n, k = q.shape[0], q.shape[1] * 2
            y = torch.empty(1, n)
            if lib.tile:
                lib.prima_q4_tiled_mm(self.tiled[i].data_ptr(), self.x[k].data_ptr(), y.data_ptr(), 1, n, k, mode,
                                      threads)
            else:
                lib.prima_q4_mm(q.data_ptr(), dm.data_ptr(), self.x[k].data_ptr(), y.data_ptr(), 1, n, k, mode,
                                threads)
            ys.append(y)
        return ys

    def output(self, lib: ctypes.CDLL, mode: int, threads: int) -> list[torch.Tensor]:
        (w, s), (n, k) = self.int8, self.shape
        y = torch.empty(1, n)
        if lib.int8_tile:
            lib.prima_int8_tiled_mm(self.int8_tiles.data_ptr(), s.data_ptr(), self.x[k].data_ptr(), y.data_ptr(), 1, n,
                                    k, mode, threads)
        else:
            lib.prima_int8_mm(w.data_ptr(), s.data_ptr(), self.x[k].data_ptr(), y.data_ptr(), 1, n, k, mode, threads)
        return [y]


def same(a: torch.Tensor, b: torch.Tensor, bits: bool) -> bool:
    """Equal bit for bit, or within float32's rounding of the sums (random weights: some outputs cancel to near 0,
    so the bound is over the largest output, 2^-24 of each of up to ~500 terms' rounding)."""
    return torch.equal(a, b) if bits else bool(((a - b).abs() <= 3e-5 * a.abs().max()).all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the git revision whose q4.c runs beside this tree's")
    ap.add_argument("--model", choices=list(MODELS), default="smollm2", help="whose matrices (8b: llama3-8b's)")
    ap.add_argument("--layers", type=int, default=30, help="layers of int4 matrices (30 of SmolLM2: 66 MB)")
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name, _ = build.chosen("q4") or (None, None)
    if name is None:
        raise SystemExit("q4.c has no build on this machine")
    flags = build.BUILDS[name][0]
    here = Path(build.__file__).with_name("q4.c")
    old = subprocess.run(["git", "show", f"{args.rev}:nodes/engine/kernels/q4.c"], capture_output=True,
                         cwd=here.parent, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        libs = {f"q4.c at {args.rev}": load(compiled(old, flags, Path(tmp) / "old.so")),
                "this tree's q4.c": load(compiled(here.read_bytes(), flags, Path(tmp) / "new.so"))}
        w = Weights(args.model, args.layers)
        for lib in libs.values():
            w.tile(lib)
        print(f"ISA {build.isa()}, q4.c {name} build, {args.threads} thread(s), {args.layers} {args.model} layers "
              f"({sum(q.numel() + dm.numel() * 2 for q, dm in w.int4) / 1e6:.0f} MB int4) and a "
              f"{w.shape[0]}x{w.shape[1]} int8 output, median ms of {args.passes} interleaved passes")
        print("| kernel | mode | " + " | ".join(libs) + " | speed-up |")
        print("| --- | --- |" + " ---: |" * (len(libs) + 1))
        for kernel in ("layers", "output"):
            for mode, m in MODES.items():
                runs = {label: getattr(w, kernel)(lib, m, args.threads) for label, lib in libs.items()}
                first = next(iter(runs.values()))
                bits = len({lib.int8_tile if kernel == "output" else lib.tile for lib in libs.values()}) == 1
                if not all(all(same(a, b, bits) for a, b in zip(first, r)) for r in runs.values()):
                    raise SystemExit(f"{kernel} {mode}: the two builds' outputs differ")
                times: dict[str, list[float]] = {label: [] for label in libs}
                for _ in range(args.passes):
                    for label, lib in libs.items():
                        t = time.perf_counter()
                        getattr(w, kernel)(lib, m, args.threads)
                        times[label].append(time.perf_counter() - t)
                med = [statistics.median(t) * 1e3 for t in times.values()]
                print(f"| {kernel} | {mode} | " + " | ".join(f"{v:.2f}" for v in med) + f" | {med[0] / med[-1]:.2f}x |")


if __name__ == "__main__":
    main()
