"""`prima-node --discover` for real: mDNS between real prima-node processes inside a network namespace of their own
(`unshare -rn`, loopback with multicast), so that nothing leaves this machine. A node given no --peer nor --join finds
the running ring and joins it before its head. Skipped, with the reason, where no namespace or no mDNS can be had."""

import json
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

from nodes.ring import discovery


def test_a_node_announces_the_address_it_binds():
    assert discovery.announced_hosts("192.168.1.5", "192.168.1.5") == ["192.168.1.5"]


def _addr(family: socket.AddressFamily, address: str) -> SimpleNamespace:  # one of psutil.net_if_addrs()'s entries
    return SimpleNamespace(family=family, address=address)


@pytest.mark.parametrize("interfaces, announced", [
    ({"lo": ["127.0.0.1", "::1"], "eth0": ["192.168.1.5", "fe80::1"], "wlan0": ["10.0.0.7"]},
     ["10.0.0.7", "192.168.1.5"]),
    ({"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"]}, ["172.17.0.1"]),
    ({"lo": ["127.0.0.1", "::1"], "eth0": ["fd00::2"]}, ["127.0.0.1"]),  # no other IPv4: loopback after all
    ({"lo": ["127.0.0.1"]}, ["127.0.0.1"]),  # a network namespace of its own, as test_discovery's ring below
    ({}, []),
], ids=["lan", "bridge", "ipv6-only", "loopback-only", "none"])
def test_bound_to_every_interface_it_announces_each_ipv4_address_but_loopback(interfaces, announced):
    given = {name: [_addr(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip) for ip in ips]
             for name, ips in interfaces.items()}
    given.get("eth0", []).append(_addr(psutil.AF_LINK, "02:fc:00:00:00:01"))  # link-layer entries are skipped
    assert discovery.lan_addresses(given) == announced


def test_on_this_machine_a_wildcard_node_announces_its_real_addresses():
    every = discovery.announced_hosts("0.0.0.0", "127.0.0.1")
    assert every and len(set(every)) == len(every)
    for ip in every:  # each one an address of this machine: a socket can bind it
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
    listed = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True) \
        if shutil.which("ip") else None
    if listed is None or listed.returncode != 0:
        pytest.skip("needs ip (iproute2) to list this machine's addresses another way")
    ips = {line.split()[3].partition("/")[0] for line in listed.stdout.splitlines()}
    lan = {ip for ip in ips if not ip.startswith("127.")}
    assert set(every) == (lan or ips)  # the LAN's addresses, loopback only on a machine with no other


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
