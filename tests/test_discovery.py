"""`prima-node --discover` for real: mDNS between real prima-node processes inside a network namespace of their own
(`unshare -rn`, loopback with multicast), so that nothing leaves this machine. A node given no --peer nor --join finds
the running ring and joins it before its head. Skipped, with the reason, where no namespace or no mDNS can be had."""

import json
import shutil
import subprocess
import sys

import pytest

from nodes.ring import discovery


def test_a_node_announces_the_address_it_binds_or_each_of_the_machines_lan_first():
    pytest.importorskip("ifaddr", reason="the discover extra (zeroconf) is not installed")
    assert discovery.announced_hosts("192.168.1.5", "192.168.1.5") == ["192.168.1.5"]
    every = discovery.announced_hosts("0.0.0.0", "127.0.0.1")
    assert "127.0.0.1" in every and every == sorted(every, key=lambda ip: ip.startswith("127."))


@pytest.mark.slow
def test_a_node_with_discover_alone_finds_the_running_ring_and_joins_it(tiny_store, tmp_path):
    pytest.importorskip("zeroconf", reason="the discover extra (zeroconf) is not installed")
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2) to make a network namespace")
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no network namespace can be made here: unshare -rn: {probe.stderr.strip()}")
    res = subprocess.run(["unshare", "-rn", sys.executable, "-m", "tests.discovery_ns", str(tiny_store),
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    if "skip" in seen:
        pytest.skip(f"mDNS cannot work in the namespace: {seen['skip']}")
    head, worker = seen["ring"]
    assert [tuple(r) for r in seen["rows"]] == [(head, "up", "head"), (worker, "up", "worker"),
                                                (seen["joiner"], "joined", "relay")]
    assert seen["tokens"] == seen["expected"]  # the ring serves through its new relay
    assert "found a running ring on the LAN" in (tmp_path / "joiner.log").read_text()
