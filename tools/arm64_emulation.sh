#!/bin/sh
# The kernels' aarch64 (NEON) builds tested on an x86 box with qemu user emulation (binfmt_misc). Timings under
# emulation say nothing about a real ARM CPU's speed. qemu's default "max" CPU has the dot product instructions,
# QEMU_CPU=cortex-a53 has not.
#   sudo tools/arm64_emulation.sh setup    # once: qemu, a cross gcc, an arm64 Debian chroot with a venv (~2 GB)
#   tools/arm64_emulation.sh quick         # seconds, no chroot: tools/kernels/check.c on avx2 and both NEON builds
#   sudo tools/arm64_emulation.sh pytest -q tests/test_kernels.py          # in the chroot: minutes a file
#   sudo env PRIMA_KERNEL_ISA=neon tools/arm64_emulation.sh pytest -q tests/test_kernel_f32.py
set -eu
ROOT=${ROOT:-/srv/arm64}
SRC=$(cd "$(dirname "$0")/.." && pwd)
# torch: PyPI's aarch64 wheels from 2.11 on are CUDA builds (cuda-toolkit, cudnn: GBs, and not all resolvable);
# 2.10.0 is the newest CPU-only one (the project's torch==2.13.0 has no CPU aarch64 wheel on PyPI)
PACKAGES="torch==2.10.0 numpy pytest gguf structlog grpcio grpcio-tools protobuf psutil rich safetensors tokenizers
 llguidance jinja2 typer sentencepiece"

mounted() { grep -q " $ROOT$1 " /proc/mounts; }

enter() { # the checkout at /src, /proc and /sys for torch and OpenMP
    mounted /proc || mount -t proc proc "$ROOT/proc"
    mounted /sys || mount -t sysfs sysfs "$ROOT/sys"
    mkdir -p "$ROOT/src"
    mounted /src || mount --bind "$SRC" "$ROOT/src"
}

quick() { # each kernel with build.py's flags for avx2, neon-dotprod and neon, and check.c beside each
    out=${TMPDIR:-/tmp}/prima-kernels-quick
    mkdir -p "$out"
    for f in q4 f32 ops; do
        own=$([ $f = ops ] && echo -ffp-contract=off || true)
        gcc -O3 -fopenmp -fPIC -shared -mavx2 -mfma -mf16c $own "$SRC/nodes/engine/kernels/$f.c" -o "$out/avx2-$f.so" -lm
        for b in neon-dotprod:armv8.2-a+dotprod neon:armv8-a; do
            aarch64-linux-gnu-gcc -O3 -fopenmp -fPIC -shared -march="${b#*:}" $own "$SRC/nodes/engine/kernels/$f.c" \
                -o "$out/${b%%:*}-$f.so" -lm
        done
    done
    gcc -O2 "$SRC/tools/kernels/check.c" -o "$out/check-x86" -ldl -lm
    aarch64-linux-gnu-gcc -O2 "$SRC/tools/kernels/check.c" -o "$out/check-arm" -ldl -lm
    libs() { echo "$out/$1-q4.so $out/$1-f32.so $out/$1-ops.so"; }
    arm() { QEMU_CPU=$1 qemu-aarch64-static -L /usr/aarch64-linux-gnu "$out/check-arm" $(libs "$2"); }
    echo "avx2 (this CPU):" && "$out/check-x86" $(libs avx2)
    echo "neon-dotprod (qemu max):" && arm max neon-dotprod
    echo "neon (qemu cortex-a53):" && arm cortex-a53 neon
    echo "neon-dotprod on a cortex-a53 (expect cpu_ok 0 0 0, then SIGILL):" && { arm cortex-a53 neon-dotprod || true; }
}

case "${1:-}" in
setup)
    apt-get install -y qemu-user-static binfmt-support debootstrap gcc-aarch64-linux-gnu
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
    [ -x "$ROOT/usr/bin/python3" ] || debootstrap --arch=arm64 --variant=minbase \
        --include=python3,python3-venv,python3-dev,gcc,libc6-dev,libgomp1,ca-certificates bookworm "$ROOT" \
        http://deb.debian.org/debian
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/" # this host's CAs (a TLS proxy's, where it has one)
    enter
    chroot "$ROOT" env -u PIP_FIND_LINKS sh -c "python3 -m venv /opt/venv && /opt/venv/bin/pip install -q $PACKAGES"
    ;;
quick) quick ;;
pytest | python)
    enter
    tool=$1
    shift
    # the project from /src, not installed (the kernels build into PRIMA_HOME at first use); the environment
    # (PRIMA_KERNEL_ISA, QEMU_CPU) passes through
    exec chroot "$ROOT" env -C /src PYTHONPATH=/src PRIMA_HOME=/tmp/prima-home /opt/venv/bin/python \
        $([ "$tool" = pytest ] && echo -m pytest) "$@"
    ;;
*)
    sed -n '2,8p' "$0"
    exit 2
    ;;
esac
