"""The chaos soak's HTTP side: the reference answers (each request of the mix to a 1-node ring: one process, the
same HTTP API) and `prima-ctl serve` in front of the soak's ring, as a user runs it."""

import subprocess
import sys
import time
from pathlib import Path

from prima_rpc.app import ring
from prima_rpc.app.local_ring import free_ports, launch
from prima_rpc.app.openai_api import ApiConfig
from tools.bench.chaos_load import MIX, send
from tools.bench.chaos_ring import ChaosRing
from tools.bench.http_harness import api_in_thread


def references(store: Path, work: Path) -> dict[str, str]:
    """Each mix request's answer from a single process (a 1-node ring holding every layer)."""
    local = launch(store, 1, log_dir=work, detach=False)
    try:
        n_layers = ring.walk(local.addresses[0])[0][1].n_layers
        ring.start(local.addresses[0], [n_layers])
        with api_in_thread(ApiConfig(local.addresses[0])) as root:
            out = {}
            for name in MIX:
                outcome = send(root, name)
                if outcome.kind != "ok":
                    raise RuntimeError(f"the reference of {name} failed: {outcome.why}")
                out[name] = outcome.answer
            return out
    finally:
        local.stop()


def serve_subprocess(chaos: ChaosRing, log: Path, timeout: float = 60) -> tuple[subprocess.Popen, str]:
    """`prima-ctl --node A,B,C,D serve` on a free port (every member named: it follows a failover); (process, root)."""
    port = free_ports(1)[0]
    cmd = [sys.executable, "-m", "prima_rpc.app.cli", "--node", ",".join(chaos.local.addresses), "serve",
           "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=chaos.local.env)
    deadline = time.monotonic() + timeout
    while b"serving " not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"prima-ctl serve did not start: {log.read_text()[-500:]}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}"
