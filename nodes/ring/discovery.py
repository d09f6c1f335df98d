"""Zero-configuration discovery on a LAN (`prima-node --discover`, off by default): each such node announces itself as
`_prima._tcp.local.` over mDNS (the zeroconf package: the `discover` extra), and one given neither --peer nor --join
browses for a node of a running ring and joins it (nodes/ring/join.py)."""

import asyncio
import socket
import time

import grpc
import psutil

from prima_rpc.control import AioControl, Deadlines

SERVICE = "_prima._tcp.local."
BROWSE_S = 30.0  # how long a node without --peer or --join looks for a running ring
ASK = Deadlines(info=2.0)
WILDCARD = ("0.0.0.0", "::", "")


class DiscoveryError(Exception):
    """No ring found, or mDNS cannot run here; the message says which."""


def _zeroconf():
    try:
        import zeroconf
        import zeroconf.asyncio
    except ImportError:
        raise DiscoveryError("--discover needs the zeroconf package: pip install 'prima-rpc[discover]'") from None
    return zeroconf, zeroconf.asyncio


def announced_hosts(host: str, advertised: str) -> list[str]:
    """The IPv4 addresses a node announces: the one it binds, or (bound to every interface) this machine's."""
    if host not in WILDCARD:
        return [advertised]
    return lan_addresses(psutil.net_if_addrs()) or [advertised]


def lan_addresses(interfaces: dict[str, list]) -> list[str]:
    """Every IPv4 address of these interfaces (psutil.net_if_addrs()'s shape) but loopback's, which no other device
    can dial; loopback's only when there is no other (a machine off every network, or a namespace of its own)."""
    ips = {a.address for addresses in interfaces.values() for a in addresses if a.family == socket.AF_INET}
    lan = sorted(ip for ip in ips if not ip.startswith("127."))
    return lan or sorted(ips)


class Announcer:
    """This node's mDNS record while it runs; close() withdraws it."""

    def __init__(self):
        self._zc = None
        self._info = None

    async def start(self, name: str, hosts: list[str], port: int, node_id: str) -> None:
        zc, azc = _zeroconf()
        label = "".join(c if c.isalnum() or c == "-" else "-" for c in (name or "prima"))[:40]
        self._info = zc.ServiceInfo(SERVICE, f"{label}-{node_id[:8]}.{SERVICE}", port=port,
                                    addresses=[socket.inet_aton(h) for h in hosts], properties={"name": name})
        try:
            started = azc.AsyncZeroconf(ip_version=zc.IPVersion.V4Only)
        except OSError as exc:
            raise DiscoveryError(f"mDNS cannot run here: {exc}") from None
        try:
            await started.async_register_service(self._info)
        except (OSError, zc.Error) as exc:
            await started.async_close()
            raise DiscoveryError(f"mDNS cannot announce this node: {exc}") from None
        self._zc = started

    async def close(self) -> None:
        if self._zc is not None:
            await self._zc.async_unregister_service(self._info)
            await self._zc.async_close()
            self._zc = None


async def find_ring(own: str, token: str | None, timeout: float = BROWSE_S) -> str:
    """HOST:PORT of an announced node that belongs to a running ring (its head, or a member that names one), not
    `own`; DiscoveryError when none is found within `timeout` s."""
    zc, azc = _zeroconf()
    loop, names = asyncio.get_running_loop(), asyncio.Queue()

    def changed(zeroconf, service_type, name, state_change):
        if state_change is not zc.ServiceStateChange.Removed:
            loop.call_soon_threadsafe(names.put_nowait, name)

    browser_zc = azc.AsyncZeroconf(ip_version=zc.IPVersion.V4Only)
    browser = azc.AsyncServiceBrowser(browser_zc.zeroconf, SERVICE, handlers=[changed])
    deadline, seen = time.monotonic() + timeout, []
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:  # a node seen before is asked again: its ring may have started since
                name = await asyncio.wait_for(names.get(), min(left, 1.0))
                seen += [name] if name not in seen else []
            except TimeoutError:
                pass
            for name in seen:
                if found := await _ring_member(browser_zc, name, own, token):
                    return found
    finally:
        await browser.async_cancel()
        await browser_zc.async_close()
    raise DiscoveryError(f"no node of a running ring announced itself on the LAN within {timeout:.0f} s (its nodes "
                         "need --discover too, and the ring a prima-ctl start)")


async def _ring_member(browser_zc, name: str, own: str, token: str | None) -> str:
    """The address of the announced node `name` if it is in a running ring, else ''."""
    info = await browser_zc.async_get_service_info(SERVICE, name, 3000)
    for address in [f"{ip}:{info.port}" for ip in info.parsed_addresses()] if info else []:
        if address != own and await _in_a_ring(address, token):
            return address
    return ""


async def _in_a_ring(address: str, token: str | None) -> bool:
    try:
        async with AioControl(address, token, ASK) as peer:
            info = await peer.info()
    except grpc.RpcError:
        return False
    return info.role == "head" or bool(info.head)
