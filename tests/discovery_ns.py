"""Run by tests/test_discovery.py inside a fresh network namespace (`unshare -rn`): loopback is brought up with
multicast, a 2-node ring announces itself (--discover), and a third node given --discover alone finds it and joins;
one JSON line says what happened ({"skip": why} when mDNS cannot work here)."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from nodes.ring import discovery
from prima_rpc.app import ring
from prima_rpc.app.local_ring import free_ports, wait_serving
from tests.rings import collect, greedy_tokens, local_ring


def loopback_with_multicast() -> str:
    """'' once lo is up with multicast routed over it, else why not."""
    for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "link", "set", "lo", "multicast", "on"],
                ["ip", "route", "add", "224.0.0.0/4", "dev", "lo"]):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            return f"{' '.join(cmd)}: {res.stderr.strip()}"
    return ""


async def mdns_works() -> str:
    """'' when a record announced here is found by a browser here (two zeroconf instances), else why not."""
    announcer = discovery.Announcer()
    try:
        await announcer.start("probe", ["127.0.0.1"], 9, "0" * 8)
        zc, azc = discovery._zeroconf()
        browser = azc.AsyncZeroconf(ip_version=zc.IPVersion.V4Only)
        try:
            info = await browser.async_get_service_info(discovery.SERVICE, f"probe-00000000.{discovery.SERVICE}", 5000)
        finally:
            await browser.async_close()
        return "" if info is not None else "an mDNS record announced on lo was not found by a browser on lo"
    except (OSError, discovery.DiscoveryError) as exc:
        return f"mDNS: {exc}"
    finally:
        await announcer.close()


def main(store: Path, log_dir: Path) -> dict:
    if why := loopback_with_multicast() or asyncio.run(mdns_works()):
        return {"skip": why}
    with local_ring(store, 2, log_dir, windows=[4, 4], extra_args=[["--discover"], ["--discover"]]) as local:
        head = local.addresses[0]
        address = f"127.0.0.1:{free_ports(1)[0]}"
        with open(log_dir / "joiner.log", "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "nodes.ring.main", "--host", "127.0.0.1", "--port",
                                     address.rpartition(":")[2], "--discover", "--cache", str(log_dir / "cache"),
                                     "--name", "joiner"], stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_serving(address, proc, 60, log=log_dir / "joiner.log")
            deadline = time.monotonic() + 60
            while address not in [a for a, _, _ in ring.status(head)] and proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            rows = [(a, s, i.role if i else "") for a, s, i in ring.status(head)]
            tokens = collect(head, "hello", 8, raw=True)[0]
        finally:
            proc.terminate()
            proc.wait(15)
    return {"ring": local.addresses, "joiner": address, "rows": rows, "tokens": tokens,
            "expected": greedy_tokens(store, "hello", 8, raw=True), "host": socket.gethostname()}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))), flush=True)
