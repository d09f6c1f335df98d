"""One device's link to the home's router, in user space: `python -m tools.testbed.shaper STATE DEVICE`.

The kernel here has no netem, so each device's link is a process. It starts in the root network namespace and
listens there on the device's addresses (for clients on the router, e.g. prima-ctl), then enters the device's
namespace and listens there on every other device's addresses. The device's node reaches another device through
it: the bytes cross this device's link (its uplink queue, both devices' latency), a Unix socket (which crosses
namespaces), then the other device's shaper (its downlink queue) and its loopback. Replies come back the same way.
So a hop between two devices pays both links, both ways, for any TCP program: ring frames, control calls, probes,
weight fetches, prima.cpp's ranks.

A link is a queue at `mbps` (its bytes leave one after another, shared by all of the device's connections) and a
one-way delay of `latency_ms` +- `jitter_ms` that keeps each connection's bytes in order. The device's control file
(RUN/NAME.ctl, JSON) adds faults while the testbed runs: {"cut_until": unix_s} holds every byte until then,
{"extra_ms": x, "extra_until": unix_s} adds latency.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

from tools.testbed import netns

CHUNK = 64 << 10
QUEUED = 64  # chunks in flight per direction of a connection before its reader waits (a TCP window, roughly)
# The loop runs on select(2), whose timeout is in microseconds: epoll's whole milliseconds, rounded up, put every
# delayed chunk ~0.5 ms late. A wake-up takes a few tens of microseconds more.
EARLY_S = 0.00005
POLL_S = 0.2


class Link:
    """One direction of the device's link: bytes leave at `mbps`, one chunk after another, across connections."""

    def __init__(self, mbps: float):
        self.bytes_per_s = mbps * 1e6 / 8
        self.free_at = 0.0

    def leave(self, nbytes: int, at: float) -> float:
        """When a chunk ready at `at` has left (loop time)."""
        start = max(at, self.free_at)
        self.free_at = start + nbytes / self.bytes_per_s
        return self.free_at


class Faults:
    """The device's control file, read every POLL_S: a cut, or extra latency, until a wall-clock time."""

    def __init__(self, path: Path):
        self.path = path
        self.cut_until = 0.0  # loop time
        self.extra_s = 0.0
        self.extra_until = 0.0

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                spec = json.loads(self.path.read_text()) if self.path.exists() else {}
                offset = loop.time() - time.time()
                self.cut_until = float(spec.get("cut_until", 0)) + offset
                self.extra_s = float(spec.get("extra_ms", 0)) / 1e3
                self.extra_until = float(spec.get("extra_until", 0)) + offset
            except (OSError, ValueError, TypeError, AttributeError):
                pass
            await asyncio.sleep(POLL_S)

    def hold(self, at: float, now: float) -> float:
        if now < self.extra_until:
            at += self.extra_s
        return max(at, self.cut_until)


class Shaper:
    def __init__(self, state: dict, index: int):
        self.state = state
        self.devices = state["devices"]
        self.me = self.devices[index]
        self.run_dir = Path(state["run_dir"])
        self.up = Link(self.me["mbps"])
        self.down = Link(self.me["mbps"])
        self.faults = Faults(self.run_dir / f"{self.me['name']}.ctl")
        self.by_name = {d["name"]: d for d in self.devices}

    def delay(self, other: dict | None) -> float:
        """One way, this device and `other` (None: the router itself), jitter drawn per chunk."""
        devices = [self.me] + ([other] if other is not None else [])
        base = sum(d["latency_ms"] for d in devices) / 1e3
        jitter = sum(d["jitter_ms"] for d in devices) / 1e3
        return max(0.0, base + random.uniform(-jitter, jitter)) if jitter else base

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link,
                   other: dict | None, delayed: bool) -> None:
        """Bytes from reader to writer through `link`; delayed: this side pays the latency of both devices."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(QUEUED)

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                wait = at - loop.time() - EARLY_S
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        last = 0.0
        try:
            while data := await reader.read(CHUNK):
                now = loop.time()
                at = link.leave(len(data), now) + (self.delay(other) if delayed else 0.0)
                last = max(self.faults.hold(at, now), last)  # a connection's bytes stay in order
                await queue.put((last, data))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put(None)
            try:
                await sender
            except (ConnectionError, OSError):
                pass
            try:
                writer.write_eof() if writer.can_write_eof() else writer.close()
            except (ConnectionError, OSError, RuntimeError):
                pass

    async def join(self, a: tuple, b: tuple, a_to_b: Link, b_to_a: Link, other: dict | None, delayed: bool) -> None:
        (ra, wa), (rb, wb) = a, b
        try:
            await asyncio.gather(self.pipe(ra, wb, a_to_b, other, delayed), self.pipe(rb, wa, b_to_a, other, delayed))
        finally:
            for w in (wa, wb):
                w.close()

    async def from_router(self, port: int, reader, writer) -> None:
        """A client on the router (prima-ctl, a test): only this device's link."""
        try:
            node = await asyncio.open_connection(self.me["ip"], port)
        except OSError:
            writer.close()
            return
        await self.join((reader, writer), node, self.down, self.up, None, True)

    async def from_device(self, reader, writer) -> None:
        """Another device's shaper, which paid both latencies: this link's queue only."""
        try:
            src, port = (await reader.readline()).decode().split()
            node = await asyncio.open_connection(self.me["ip"], int(port))
        except (OSError, ValueError, UnicodeDecodeError):
            writer.close()
            return
        await self.join((reader, writer), node, self.down, self.up, self.by_name.get(src), False)

    async def to_device(self, other: dict, port: int, reader, writer) -> None:
        """This device's program dials another device."""
        try:
            remote = await asyncio.open_unix_connection(str(self.run_dir / f"{other['name']}.sock"))
        except OSError:
            writer.close()
            return
        remote[1].write(f"{self.me['name']} {port}\n".encode())
        await self.join((reader, writer), remote, self.up, self.down, other, True)


def _listen(ip: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, port))
    s.listen(128)
    s.setblocking(False)
    return s


def ports(device: dict) -> list[int]:
    return [device["port"], *device["expose"]]


async def serve(shaper: Shaper, outside: list[tuple[int, socket.socket]],
                inside: list[tuple[dict, int, socket.socket]]) -> None:
    me = shaper.me
    servers = [await asyncio.start_server(lambda r, w, p=p: shaper.from_router(p, r, w), sock=s) for p, s in outside]
    servers += [await asyncio.start_server(lambda r, w, o=o, p=p: shaper.to_device(o, p, r, w), sock=s)
                for o, p, s in inside]
    sock = shaper.run_dir / f"{me['name']}.sock"
    sock.unlink(missing_ok=True)
    servers.append(await asyncio.start_unix_server(shaper.from_device, path=str(sock)))
    watch = asyncio.create_task(shaper.faults.watch())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    (shaper.run_dir / f"{me['name']}.ready").write_text("ready\n")
    await stop.wait()
    watch.cancel()
    for s in servers:
        s.close()


def prompt() -> None:
    """A link delivers on time whatever the devices compute: the shaper wakes ahead of every node (real-time
    round-robin at a low priority; the kernel's RT throttling still bounds it)."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    prompt()
    state = json.loads(Path(argv[0]).read_text())
    shaper = Shaper(state, int(argv[1]))
    me = shaper.me
    outside = [(p, _listen(me["ip"], p)) for p in ports(me)]  # the root namespace: the router's side
    netns.enter(me["netns"])
    inside = [(o, p, _listen(o["ip"], p)) for o in shaper.devices if o is not me for p in ports(o)]
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        loop.run_until_complete(serve(shaper, outside, inside))
    finally:
        loop.close()


if __name__ == "__main__":
    main(sys.argv[1:])
