"""Read mechanisms side by side (`bench_offload --read-bench`): GB/s and reader CPU of four ways to read a layer
file, alone and beside a decode-like compute thread."""

import mmap
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nodes.engine.fused import empty_layer, layer_targets
from nodes.engine.store import LayerStore
from prima_rpc.spec.manifest import ModelConfig

MB = 1 << 20


def drop(path: Path) -> None:
    """Evict the file from the page cache, so that the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def read_paths(store: LayerStore, files: list[Path]) -> dict[str, Callable[[Path], int]]:
    """name -> read(path) -> bytes, for each read path: one of the store's layer files read, then dropped."""
    cfg = store.config
    size = max(p.stat().st_size for p in files)
    buf = torch.frombuffer(mmap.mmap(-1, size + 64), dtype=torch.uint8)
    fused = layer_targets(empty_layer(cfg, torch.float32), cfg)

    def read_bytes(path):  # the old LayerStore.read_bytes + safetensors load: a fresh copy per read
        data = path.read_bytes()
        drop(path)
        return len(data)

    def readinto(path):  # buffered into a reused buffer
        view = memoryview(buf.numpy())
        with open(path, "rb", buffering=0) as f:
            n = f.readinto(view[:path.stat().st_size])
        drop(path)
        return n

    def mmap_touch(path):  # prima.cpp-style: map, MADV_WILLNEED, fault every page in
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            m.madvise(mmap.MADV_WILLNEED)
            pages = np.frombuffer(m, dtype=np.uint8)
            pages[::4096].sum()
            del pages
            m.madvise(mmap.MADV_DONTNEED)
            n = len(m)
        drop(path)
        return n

    def direct(path):  # the nodes' path: O_DIRECT chunks in flight, memmove into the fused layer
        unit = f"layer.{files.index(path)}"
        return store.read_into(unit, fused)

    return {"read() + fadvise (old path)": read_bytes, "buffered readinto + fadvise": readinto,
            "mmap + WILLNEED + touch": mmap_touch, "O_DIRECT chunks + memmove (nodes)": direct}


class Compute:
    """A decode-like compute thread: one row through four layer-sized matrices, over and over, from start() to
    stop(), which returns its iterations."""

    def __init__(self, cfg: ModelConfig):
        self.weights = [torch.randn(2 * cfg.intermediate, cfg.hidden) for _ in range(4)]
        self.x = torch.randn(1, cfg.hidden)

    def _run(self, halt: threading.Event, out: list) -> None:
        n = 0
        while not halt.is_set():
            for w in self.weights:
                F.linear(self.x, w)
            n += 1
        out.append(n)

    def start(self) -> None:
        self.halt, self.out = threading.Event(), []
        self.thread = threading.Thread(target=self._run, args=(self.halt, self.out))
        self.thread.start()

    def stop(self) -> int:
        self.halt.set()
        self.thread.join()
        return self.out[0]

    def rate(self, seconds: float = 1.5) -> float:
        """Iterations a second with nothing else running."""
        self.start()
        time.sleep(seconds)
        return self.stop() / seconds


def thread_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def time_reads(read: Callable[[Path], int], chunk: list[Path], beside: Compute | None) -> tuple[int, float, float,
                                                                                                 int | None]:
    """(bytes, seconds, reader CPU seconds, compute iterations or None) of reading the chunk's files from the disk,
    beside the compute thread if given."""
    for p in chunk:
        drop(p)
    if beside:
        beside.start()
    c, begin = thread_cpu(), time.perf_counter()
    total = sum(read(p) for p in chunk)
    dt, dc = time.perf_counter() - begin, thread_cpu() - c
    return total, dt, dc, beside.stop() if beside else None


def read_bench(store_dir: Path) -> None:
    """GB/s and reader CPU per layer of four read paths, alone and beside a decode-like compute thread."""
    store = LayerStore(store_dir, verify=False)
    files = [store_dir / store.entry(f"layer.{i}").path for i in range(store.config.n_layers)]
    methods = read_paths(store, files)
    compute = Compute(store.config)
    alone = compute.rate()
    per = max(2, min(6, len(files) // (2 * len(methods))))
    stats = {name: {"gbs": [], "cpu": [], "gbs_busy": [], "compute": []} for name in methods}
    i = 0
    for _ in range(2):  # two passes, methods interleaved: noise from the shared machine hits all alike
        for name, read in methods.items():
            for busy in (False, True):
                chunk = [files[(i + j) % len(files)] for j in range(per)]
                i += per
                total, dt, dc, iterations = time_reads(read, chunk, compute if busy else None)
                if busy:
                    stats[name]["gbs_busy"].append(total / dt / 1e9)
                    stats[name]["compute"].append(iterations / dt / alone)
                else:
                    stats[name]["gbs"].append(total / dt / 1e9)
                    stats[name]["cpu"].append(dc / len(chunk) * 1e3)
    size = max(p.stat().st_size for p in files)
    print(f"\n{len(files)} layer files of {size / MB:.0f} MB; compute alone {alone:.0f} it/s\n")
    print("| read path | GB/s alone | reader CPU ms/layer | GB/s beside compute | compute speed while reading |")
    print("|---|---|---|---|---|")
    for name, s in stats.items():
        print(f"| {name} | {statistics.mean(s['gbs']):.2f} | {statistics.mean(s['cpu']):.1f} | "
              f"{statistics.mean(s['gbs_busy']):.2f} | {statistics.mean(s['compute']):.0%} |")
