"""Compiles a kernel's C source for this machine's instruction set at first use and loads it (ctypes), cached in
$PRIMA_HOME/kernels by source, flags and compiler; None where there is no compiler or the ISA has no build."""

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
# The flags of each instruction set a kernel has a build for, by torch's name for what it may use here (so
# ATEN_CPU_CAPABILITY=avx2 limits these kernels as it limits torch's). AVX-512 machines run the AVX2 build.
FLAGS = {"AVX2": ("-mavx2", "-mfma", "-mf16c"), "AVX512": ("-mavx2", "-mfma", "-mf16c")}
COMMON = ("-O3", "-fopenmp", "-fPIC", "-shared")  # libgomp: torch's own, already loaded, so one thread pool


def isa() -> str:
    """torch's CPU capability (AVX512, AVX2, DEFAULT, ...), as limited by ATEN_CPU_CAPABILITY."""
    return torch.backends.cpu.get_cpu_capability()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@cache
def library(name: str) -> ctypes.CDLL | None:
    """nodes/engine/kernels/NAME.c built for this machine, or None (no build for its ISA, no compiler, or the
    compiler failed: said once in the log; torch's kernels are used instead)."""
    flags, cc = FLAGS.get(isa()), compiler()
    if platform.machine().lower() not in ("x86_64", "amd64") or flags is None or cc is None:
        return None
    try:
        return ctypes.CDLL(str(built(name, cc, flags)))
    except (OSError, subprocess.CalledProcessError) as exc:  # no such compiler, it failed, or the file won't load
        structlog.get_logger().warning("kernel_build_failed", kernel=name, compiler=cc,
                                       error=str(exc), stderr=(getattr(exc, "stderr", "") or "")[-2000:])
        return None


def built(name: str, cc: str, flags: tuple[str, ...]) -> Path:
    """The shared library of NAME.c for these flags, compiled unless this home already has it."""
    source = (HERE / f"{name}.c").read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[:1]
    key = hashlib.sha256(source + repr((flags, COMMON, version)).encode()).hexdigest()[:16]
    out = prima_home() / "kernels" / f"{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *COMMON, *flags, str(HERE / f"{name}.c"), "-o", tmp, "-lm"], capture_output=True,
                           text=True, check=True)
            os.replace(tmp, out)  # atomic: processes building at once each write a whole file
        finally:
            Path(tmp).unlink(missing_ok=True)
    return out
