"""The chaos soak's ring: real prima-node processes on loopback that the faults kill, stop, restart, add and take
away, with what the soak needs to know of them (who is alive, stopped, the head, the standby) and to measure."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from prima_rpc.app import ring
from prima_rpc.app.local_ring import LocalRing, free_ports, launch
from prima_rpc.control import Control, Deadlines

QUICK = Deadlines(info=2.0)


@dataclass
class Member:
    """A node process the soak started: its command (to start it again as it was) and its process."""

    name: str
    command: list[str]
    proc: subprocess.Popen
    gone: bool = False  # it left the ring (prima-ctl leave): forgotten, never started again
    killed: bool = False  # the soak killed it (else a process that ended did so on its own: a failure)


def open_fds(pid: int) -> int:
    """Open descriptors that could leak: a cached prefix keeps one memfd a layer (nodes/engine/kv_share.py) as long as
    the cache holds it, so those count with the prefix cache (bounded by its bytes), not here."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return psutil.Process(pid).num_fds()
    return sum(not link.startswith("/memfd:prima-prefix") for link in links)


def anon_rss(pid: int) -> int:
    """A process's anonymous resident bytes (RssAnon): what a leak grows. Pages of mapped files (the store's
    safetensors read through mmap) are page cache the kernel takes back, not the process's to leak."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return psutil.Process(pid).memory_info().rss


class ChaosRing:
    def __init__(self, store: Path, n: int, work: Path):
        self.store, self.work = store, work
        self.local: LocalRing = launch(store, n, log_dir=work / "logs", detach=False)
        self.nodes = {a: Member(f"node{i}", c, p) for i, (a, c, p) in
                      enumerate(zip(self.local.addresses, self.local.commands, self.local.processes))}
        self.stopped: dict[str, float] = {}  # SIGSTOPped address -> when it is continued
        self.joined = 0

    # -- what is there
    def alive(self) -> list[str]:
        return [a for a, m in self.nodes.items() if m.proc.poll() is None and not m.gone]

    def running(self) -> list[str]:
        """Alive and not stopped: the nodes that answer."""
        return [a for a in self.alive() if a not in self.stopped]

    def dead(self) -> list[str]:
        return [a for a, m in self.nodes.items() if m.proc.poll() is not None and not m.gone]

    def status(self) -> list[tuple[str, str, object]]:
        """ring.status asked of the running nodes in turn (the first that gives a head's view)."""
        last: Exception | None = None
        for address in self.running():
            try:
                rows = ring.status(address)
                if rows and rows[0][2] is not None and rows[0][2].role == "head":
                    return rows
            except ring.RingError as exc:
                last = exc
        raise ring.RingError(f"no running node gives the ring's view: {last}")

    def head_and_standby(self) -> tuple[str, str]:
        rows = self.status()
        members = [a for a, s, i in rows if i is not None]
        return members[0], (members[1] if len(members) > 1 else "")

    def info(self, address: str):
        try:
            with Control(address, None, QUICK) as peer:
                return peer.info()
        except grpc.RpcError:
            return None

    # -- what the faults do
    def kill(self, address: str) -> None:
        member = self.nodes[address]
        member.killed = True
        member.proc.kill()
        member.proc.wait()

    def exited(self) -> dict[str, int]:
        """name -> exit status of each node that ended on its own (not killed, not left)."""
        return {m.name: m.proc.returncode for m in self.nodes.values()
                if m.proc.poll() is not None and not m.killed and not m.gone}

    def stop_for(self, address: str, seconds: float) -> None:
        os.kill(self.nodes[address].proc.pid, signal.SIGSTOP)
        self.stopped[address] = time.monotonic() + seconds

    def continue_due(self, now: float | None = None) -> list[str]:
        """SIGCONT every stopped node whose time is up (all of them with now=inf); those continued."""
        now = time.monotonic() if now is None else now
        due = [a for a, at in self.stopped.items() if at <= now]
        for address in due:
            if self.nodes[address].proc.poll() is None:
                os.kill(self.nodes[address].proc.pid, signal.SIGCONT)
            del self.stopped[address]
        return due

    def restart(self, address: str) -> None:
        """Start the node again with its command (SIGTERM first if it runs); not waited for, as a user's restart
        is not: the node rejoins on its own (or ends, which the health check reports)."""
        member = self.nodes[address]
        if member.proc.poll() is None:
            member.killed = True
            member.proc.terminate()
            member.proc.wait(30)
        member.proc, member.killed = self.local.spawn(member.name, member.command), False

    def join(self, via: str) -> str:
        """A new node (no model: it fetches the ring's) joining through `via`; its address."""
        self.joined += 1
        name = f"joiner{self.joined}"
        address = f"127.0.0.1:{free_ports(1)[0]}"
        command = [sys.executable, "-m", "nodes.ring.main", "--host", "127.0.0.1", "--port",
                   address.rpartition(":")[2], "--join", via, "--name", name, "--cache", str(self.work / name)]
        self.nodes[address] = Member(name, command, self.local.spawn(name, command))  # it joins on its own
        return address

    def ctl(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """prima-ctl, as a user runs it."""
        return subprocess.run([sys.executable, "-m", "prima_rpc.app.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=self.local.env)

    # -- what is measured
    def resources(self) -> dict[str, tuple[int, int, int, int]]:
        """address -> (pid, RSS bytes, open fds, bytes of weights it holds) of every running node."""
        out = {}
        for address in self.running():
            info = self.info(address)
            try:
                p = psutil.Process(self.nodes[address].proc.pid)
                out[address] = (p.pid, anon_rss(p.pid), open_fds(p.pid), info.stats.resident_bytes if info else 0)
            except psutil.Error:
                pass
        return out

    def disk_bytes(self) -> int:
        """Bytes under the soak's directory but its logs: the caches joiners fetch into."""
        return sum(p.stat().st_size for p in self.work.rglob("*") if p.is_file() and "logs" not in p.parts)

    def close(self) -> None:
        self.continue_due(float("inf"))
        for member in self.nodes.values():
            if member.proc.poll() is None:
                member.proc.terminate()
        for member in self.nodes.values():
            try:
                member.proc.wait(10)
            except subprocess.TimeoutExpired:
                member.proc.kill()
                member.proc.wait()
