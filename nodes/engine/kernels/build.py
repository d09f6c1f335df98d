"""Compiles a kernel's C source for this machine's instruction set (x86: AVX2, AVX-512; aarch64: NEON) at first use
and loads it (ctypes), cached in $PRIMA_HOME/kernels by source (with the headers beside it), flags and compiler; None
where there is no compiler or the ISA has no build."""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import structlog
import torch

from prima_rpc.spec.home import prima_home

HERE = Path(__file__).parent
AVX2 = ("-mavx2", "-mfma", "-mf16c")
AVX512 = (*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
X86, ARM = ("x86_64", "amd64"), ("aarch64", "arm64")  # platform.machine(), lower case (arm64: macOS)
ANY = None  # every torch capability: NEON is part of every aarch64 CPU, so torch's DEFAULT kernels there use it too
# Each build: the flags it is compiled with, the torch CPU capabilities under which it may run (so
# ATEN_CPU_CAPABILITY=avx2 limits these kernels as it limits torch's) and the machines it is for, best first. A build
# is used where the CPU runs it (the library's own prima_cpu_ok: __builtin_cpu_supports, or aarch64's HWCAP bits);
# PRIMA_KERNEL_ISA=NAME asks for one.
BUILDS = {
    "avx512vnni": ((*AVX512, "-mavx512vnni"), ("AVX512",), X86),
    "avx512": (AVX512, ("AVX512",), X86),
    "avx2": (AVX2, ("AVX2", "AVX512"), X86),
    "neon-dotprod": (("-march=armv8.2-a+dotprod",), ANY, ARM),  # vdotq_s32: 16 int8 products a step
    "neon": (("-march=armv8-a",), ANY, ARM),  # vmull_s8 + vpadalq_s16: any aarch64 CPU
}
COMMON = ("-O3", "-fopenmp", "-fPIC", "-shared")  # libgomp: torch's own, already loaded, so one thread pool
# a kernel's own flags: ops.c's products and sums round one at a time, as torch's elementwise ops (no fused a*b+c)
OWN = {"ops": ("-ffp-contract=off",)}
ENV = "PRIMA_KERNEL_ISA"


def isa() -> str:
    """torch's CPU capability (AVX512, AVX2, DEFAULT, ...), as limited by ATEN_CPU_CAPABILITY."""
    return torch.backends.cpu.get_cpu_capability()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def candidates() -> list[str]:
    """The builds that may run here, best first: PRIMA_KERNEL_ISA's alone where it is set."""
    asked = os.environ.get(ENV, "").strip().lower()
    if asked and asked not in BUILDS:
        raise ValueError(f"{ENV}={asked!r} is not a kernel build; known: {', '.join(BUILDS)}")
    names = [asked] if asked else list(BUILDS)
    here = platform.machine().lower()
    return [b for b in names if here in BUILDS[b][2] and (BUILDS[b][1] is ANY or isa() in BUILDS[b][1])]


@cache
def chosen(name: str) -> tuple[str, ctypes.CDLL] | None:
    """(build, library) of nodes/engine/kernels/NAME.c for this machine: the first of candidates() that compiles and
    that the CPU runs; None where none does (no build for its ISA, no compiler, or every build failed: said in the
    log; torch's kernels are used instead)."""
    cc = compiler()
    if cc is None:
        return None
    for build in candidates():
        try:
            lib = ctypes.CDLL(str(built(name, cc, BUILDS[build][0] + OWN.get(name, ()))))
        except (OSError, subprocess.CalledProcessError) as exc:  # no such compiler, it failed (an old one without
            # these flags: the next build may do), or the file won't load
            structlog.get_logger().warning("kernel_build_failed", kernel=name, build=build, compiler=cc,
                                           error=str(exc), stderr=(getattr(exc, "stderr", "") or "")[-2000:])
            continue
        if lib.prima_cpu_ok():
            return build, lib
    return None


def library(name: str) -> ctypes.CDLL | None:
    found = chosen(name)
    return None if found is None else found[1]


def built(name: str, cc: str, flags: tuple[str, ...]) -> Path:
    """The shared library of NAME.c for these flags, compiled unless this home already has it."""
    source = (HERE / f"{name}.c").read_bytes() + b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[:1]
    key = hashlib.sha256(source + repr((flags, COMMON, version)).encode()).hexdigest()[:16]
    out = prima_home() / "kernels" / f"{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *COMMON, *flags, str(HERE / f"{name}.c"), "-o", tmp, "-lm"], capture_output=True,
                           text=True, check=True)  # "cpu_ok.h" is found beside the source
            os.replace(tmp, out)  # atomic: processes building at once each write a whole file
        finally:
            Path(tmp).unlink(missing_ok=True)
    return out
