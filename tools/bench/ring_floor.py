"""The floors under a local ring's decode TPOT on this machine, side by side in one run: what the layers cost in one
process, what splitting them across processes costs, and what a gRPC hop costs with no model at all. A real ring's
TPOT (bench_ring, token_budget) minus these is the ring's own work: its Python, codec and hand-offs.

    python -m tools.bench.ring_floor [--store int4] [--windows 10 10 10] [--steps 300] [--repeats 3]

Rows, each the median of --repeats runs, interleaved:
- one process, one window: the store's layers (no logits, no sampling) for one token at one thread, as the
  single-process reference runs them;
- one process, N windows: the same layers as N Shards, one after another (the windows' own cost);
- N processes over OS pipes: each a Shard of its window, the hidden state passed on through a pipe and back to the
  first (what separate processes cost: on a 2-core VM their layers run slower than in one process);
- the same, every process on CPU 0 (taskset), where the machine has more than one CPU;
- N processes, gRPC aio: bidirectional streams around N processes forwarding a decode frame's bytes, no model (the
  floor of the ring's transport; "per hop" = the round trip / N).
Positions run from 0 to --steps, as a decode would; every process runs at one torch thread.
"""

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch

from tools.bench.markdown import table

GRPC_STEPS = 1500


def spans(windows: list[int]) -> list[tuple[int, int]]:
    """[start, stop) of each window, one after another from layer 0."""
    return [(sum(windows[:i]), sum(windows[:i + 1])) for i in range(len(windows))]


def shards(store: Path, ranges: list[tuple[int, int]]):
    """A Shard of each range (float32 activations, no head)."""
    from nodes.engine.shard import Shard
    from nodes.engine.store import LayerStore
    from prima_rpc.spec.windows import Windows

    layers = LayerStore(store)
    return [Shard(layers, Windows((r,), layers.config.n_layers, False), torch.float32) for r in ranges]


def in_process(store: Path, windows: list[int], steps: int) -> float:
    """ms a token through `windows` as Shards in this process."""
    torch.set_num_threads(1)
    parts = shards(store, spans(windows))
    caches = [s.cache_for("floor", 0, steps + 1, 1) for s in parts]
    x0 = torch.randn(1, parts[0].cfg.hidden) * 0.1
    took = []
    for pos in range(steps):
        start, x, nxt = time.perf_counter(), x0, 0
        for shard, cache in zip(parts, caches):
            x, nxt = shard.compute(x, cache, pos, nxt)
        took.append(time.perf_counter() - start)
    return statistics.median(took[steps // 10:]) * 1e3


def pipe_node(store: Path, windows: list[int], i: int, steps: int, rx, tx, out) -> None:
    """Window i of a ring of processes over pipes; the first times each token's trip and puts the median on out."""
    torch.set_num_threads(1)
    first, stop = spans(windows)[i]
    (shard,) = shards(store, [(first, stop)])
    cache = shard.cache_for("floor", 0, steps + 1, 1)
    x0, took = torch.randn(1, shard.cfg.hidden) * 0.1, []
    out.put("ready")
    for pos in range(steps):
        start = time.perf_counter()
        x = x0 if i == 0 else torch.frombuffer(bytearray(rx.recv_bytes()), dtype=torch.float32).view(1, -1)
        x, _ = shard.compute(x, cache, pos, first)
        tx.send_bytes(x.numpy().tobytes())
        if i == 0:
            rx.recv_bytes()
            took.append(time.perf_counter() - start)
    if i == 0:
        out.put(statistics.median(took[steps // 10:]) * 1e3)


def over_pipes(store: Path, windows: list[int], steps: int, cpus: set[int] | None) -> float:
    """ms a token around len(windows) processes joined by pipes (cpus: the CPUs they may run on)."""
    ctx = mp.get_context("spawn")
    n, out = len(windows), ctx.Queue()
    pipes = [ctx.Pipe(duplex=False) for _ in range(n)]  # pipe i carries node i's output to node i + 1
    procs = [ctx.Process(target=pipe_node, args=(store, windows, i, steps, pipes[i - 1][0], pipes[i][1], out))
             for i in range(n)]
    for p in procs:
        p.start()
        if cpus:
            os.sched_setaffinity(p.pid, cpus)
    for _ in procs:
        assert out.get(timeout=600) == "ready"
    ms = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return ms


def grpc_node(i: int, n: int, port: int, size: int, out) -> None:
    """One process of a gRPC ring that forwards each message to the next; the first sends GRPC_STEPS messages
    one at a time and puts the median round trip (ms) on out."""
    import grpc
    import uvloop

    async def main():
        got: asyncio.Queue = asyncio.Queue()

        async def forward(stream, context):
            async for message in stream:
                await got.put(message)
            if False:  # a stream-stream handler must be an async generator
                yield b""

        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "floor.Ring", {"Forward": grpc.stream_stream_rpc_method_handler(forward)})])
        server.add_insecure_port(f"127.0.0.1:{port + i}")
        await server.start()
        out.put("ready")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port + (i + 1) % n}")
        await channel.channel_ready()
        call = channel.stream_stream("/floor.Ring/Forward")()
        if i:
            while True:
                await call.write(await got.get())
        message, took = bytes(size), []
        await asyncio.sleep(0.5)  # every process's stream open
        for _ in range(GRPC_STEPS):
            start = time.perf_counter()
            await call.write(message)
            await got.get()
            took.append(time.perf_counter() - start)
        out.put(statistics.median(took[GRPC_STEPS // 10:]) * 1e3)

    uvloop.run(main())


def grpc_ring(n: int, size: int) -> float:
    """ms of a message of `size` bytes (a decode frame's) going round n gRPC aio processes on loopback."""
    from prima_rpc.app.local_ring import free_ports

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_ports(n, 24000)[0]  # ports port .. port + n - 1
    procs = [ctx.Process(target=grpc_node, args=(i, n, port, size, out), daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=120) == "ready"
    ms = out.get(timeout=600)
    for p in procs:
        p.terminate()
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="int4", help="the default model's store: int4 (its Q4_1 blocks), float32")
    p.add_argument("--windows", type=int, nargs="+", default=[10, 10, 10])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    from prima_rpc.spec.manifest import read_manifest
    from tools.bench.bench_ring import frame_bytes
    from tools.default_model import ensure_default_store

    store = ensure_default_store(dtype=None if a.store == "float32" else a.store)
    n, hidden = len(a.windows), read_manifest(store)[0].config.hidden
    rows = {"one process, one window": lambda: in_process(store, [sum(a.windows)], a.steps),
            f"one process, {n} windows": lambda: in_process(store, a.windows, a.steps),
            f"{n} processes over pipes": lambda: over_pipes(store, a.windows, a.steps, None)}
    if len(os.sched_getaffinity(0)) > 1:
        rows[f"{n} processes over pipes, all on CPU 0"] = lambda: over_pipes(store, a.windows, a.steps, {0})
    rows[f"{n} processes, gRPC aio, no model"] = lambda: grpc_ring(n, frame_bytes(hidden, "float32"))
    ms: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(a.repeats):  # interleaved: a drifting machine's speed hits every row alike
        for name, run in rows.items():
            ms[name].append(run())
    print(f"{store.name}, windows {a.windows}, {a.steps} positions, torch {torch.backends.cpu.get_cpu_capability()}")
    print(table(["floor", "ms a token (median)", "runs"],
                [[name, f"{statistics.median(v):.2f}" + (f" ({statistics.median(v) / n * 1e3:.0f} us a hop)"
                                                         if "gRPC" in name else ""),
                  " ".join(f"{x:.2f}" for x in v)] for name, v in ms.items()], right=[1]))


if __name__ == "__main__":
    main()
