"""A loopback ring whose links carry an added latency, for benchmarks: n prima-node processes, each --peer
pointing at a delay proxy (tools/bench/delay_proxy.py) in front of its successor, so every hop pays the delay.
The head may run under tools/bench/replay_drafter.py (a drafter that replays the target's own output)."""

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import prima_rpc
from prima_rpc.app import ring
from prima_rpc.app.local_ring import LocalRing, free_ports, threads_each, wait_serving


def even_windows(n_layers: int, n: int) -> list[int]:
    return [n_layers // n + (1 if i < n_layers % n else 0) for i in range(n)]


@contextmanager
def delayed_ring(store: Path, n: int, log_dir: Path, link_ms: float, windows: list[int],
                 extra_args: list[list[str]] | None = None, replay: Path | None = None) -> Iterator[str]:
    """The head's address of a started ring; replay: the head drafts by replaying this file (--draft needed)."""
    ports = free_ports(2 * n)
    nodes, proxies = ports[:n], ports[n:]
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if n > 1 and not prima_rpc.OPENMP_SET_BY_USER:
        env["GOMP_SPINCOUNT"] = prima_rpc.SHARED_SPIN
    env.setdefault("OMP_NUM_THREADS", str(threads_each(n)))
    if replay is not None:
        env["PRIMA_REPLAY"] = str(replay)
    routes = [f"{p}=127.0.0.1:{a}" for p, a in zip(proxies, nodes)]
    with open(log_dir / "proxy.log", "wb") as log:
        proxy = subprocess.Popen([sys.executable, "-m", "tools.bench.delay_proxy", "--delay-ms", str(link_ms),
                                  *routes], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    local = LocalRing([f"127.0.0.1:{p}" for p in nodes], log_dir, env=env, detach=False)
    try:
        for i, port in enumerate(nodes):
            main = "tools.bench.replay_drafter" if i == 0 and replay is not None else "nodes.ring.main"
            local.commands.append([sys.executable, "-m", main, "--host", "127.0.0.1", "--port", str(port),
                                   "--peer", f"127.0.0.1:{proxies[(i + 1) % n]}", "--name", f"node{i}",
                                   "--model", str(store), *(extra_args[i] if extra_args else [])])
            local.start_node(i, fresh=True)
        for i, (address, proc) in enumerate(zip(local.addresses, local.processes)):
            wait_serving(address, proc, 600.0, None, local.log(f"node{i}"))
        ring.start(local.addresses[0], windows)
        yield local.addresses[0]
    finally:
        local.stop()
        proxy.terminate()
        proxy.wait()
