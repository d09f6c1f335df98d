"""Start N prima-node processes on loopback, each pointing at the next, and wait until they serve.

A ring started without a log directory of its own lives in `$PRIMA_HOME/run/<first port>/`: its logs, a
`ring.json` (addresses, and the command of every process it started) and one `NAME.pid` per live process,
so `prima-ctl down --local` can stop it when no node answers and a second `up` on its ports is refused.
"""

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

import prima_rpc
from prima_rpc.channel import TOKEN_ENV
from prima_rpc.control import Control, Deadlines

RING_FILE = "ring.json"


class LaunchError(Exception):
    """A local ring that cannot start (its message names the node's log)."""


def run_dir(port: int) -> Path:
    """Where the local ring whose first node serves on `port` keeps its logs and pid files."""
    from prima_rpc.spec.home import prima_home

    return prima_home() / "run" / str(port)


@dataclass
class LocalRing:
    addresses: list[str]
    log_dir: Path
    processes: list[subprocess.Popen] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    detach: bool = True

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def spawn(self, name: str, command: list[str], fresh: bool = False) -> subprocess.Popen:
        """Start a process of this ring with its output in NAME.log (appended unless fresh) and record it."""
        with open(self.log(name), "wb" if fresh else "ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=self.detach, env=self.env)
        (self.log_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
        record = self.log_dir / RING_FILE
        saved = json.loads(record.read_text()) if record.is_file() else {}
        saved["addresses"] = self.addresses
        saved.setdefault("commands", {})[name] = command
        record.write_text(json.dumps(saved, indent=1))
        return proc

    def start_node(self, i: int, fresh: bool = False) -> subprocess.Popen:
        """(Re)start node i with the command it was first started with."""
        proc = self.spawn(f"node{i}", self.commands[i], fresh)
        if i < len(self.processes):
            self.processes[i] = proc
        else:
            self.processes.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for i in range(len(self.processes)):
            (self.log_dir / f"node{i}.pid").unlink(missing_ok=True)


@dataclass(frozen=True)
class Recorded:
    """A local ring as its directory records it: what `up --local` started, alive or not."""

    directory: Path
    addresses: list[str]
    commands: dict[str, list[str]]  # process name (node0, ..., serve) -> its command line

    @classmethod
    def read(cls, directory: Path) -> "Recorded | None":
        try:
            saved = json.loads((directory / RING_FILE).read_text())
            return cls(directory, list(saved["addresses"]), dict(saved["commands"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def alive(self) -> dict[str, int]:
        """name -> pid of each recorded process still running the command it was started with."""
        import psutil

        out = {}
        for name, command in self.commands.items():
            try:
                pid = int((self.directory / f"{name}.pid").read_text())
                if psutil.Process(pid).cmdline() == command:
                    out[name] = pid
            except (OSError, ValueError, psutil.Error):
                pass
        return out

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        """SIGTERM every live process (nodes and the HTTP server stop gracefully), SIGKILL what remains after
        `timeout`; forget them. Returns what was alive."""
        import psutil

        alive = self.alive()
        procs = []
        for pid in alive.values():
            try:
                proc = psutil.Process(pid)
                proc.terminate()
                procs.append(proc)
            except psutil.Error:
                pass
        _, left = psutil.wait_procs(procs, timeout=timeout)
        for proc in left:
            proc.kill()
        psutil.wait_procs(left, timeout=5)
        for name in self.commands:
            (self.directory / f"{name}.pid").unlink(missing_ok=True)
        return alive


def recorded_rings() -> list[Recorded]:
    from prima_rpc.spec.home import prima_home

    found = (Recorded.read(d) for d in sorted((prima_home() / "run").glob("*/")))
    return [r for r in found if r is not None]


def free_ports(n: int, base: int = 0, option: str = "--base-port") -> list[int]:
    """Ports base, base+1, ..., base+n-1, or (base 0) any n the kernel offers. Probed with SO_REUSEADDR,
    as gRPC binds, so a port that only lingers in TIME_WAIT after a ring stopped counts as free. `option`: the
    one that chooses these ports, named when one is taken."""
    ports: list[int] = []
    socks = []
    try:
        for i in range(n):
            s = socket.socket()
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", base + i if base else 0))
            except OSError as exc:
                raise LaunchError(f"port {base + i} is in use ({exc.strerror}); choose "
                                  f"{'another' if n == 1 else 'other ports'} with {option}") from None
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def threads_each(n: int) -> int:
    """Torch threads for each of n nodes sharing this machine's cores: a share each, at least one. Two threads a
    node on 2 cores, 3 nodes, leave a node's compute waiting on a thread another process holds (SmolLM2 int4,
    k = 1, one run: 43.5 ms a token against 33.6 with one thread; docs/performance.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // n)


def launch(model: Path | None, n: int, base_port: int = 0, *, log_dir: Path | None = None,
           extra_args: list[list[str]] | None = None, models: list[Path | None] | None = None,
           detach: bool = True, timeout: float = 60.0, token: str | None = None) -> LocalRing:
    """Start n nodes; node i gets models[i] (default: `model`) and extra_args[i]. The token reaches them in
    their environment ($PRIMA_TOKEN), never on their command lines."""
    if base_port:
        running = Recorded.read(run_dir(base_port))
        if running is not None and running.alive():
            raise LaunchError(f"a local ring is already up on {', '.join(running.addresses)} (logs and pid files in "
                              f"{running.directory}); use it (prima-ctl --node {running.addresses[0]} chat) or "
                              "stop it (prima-ctl down --local)")
    ports = free_ports(n, base_port)
    log_dir = log_dir or run_dir(ports[0])
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in [*log_dir.glob("*.pid"), log_dir / RING_FILE]:  # a ring that is gone: its records go too
        old.unlink(missing_ok=True)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    env = dict(os.environ)
    if n > 1 and not prima_rpc.OPENMP_SET_BY_USER:  # nodes sharing the cores spin briefly (prima_rpc/__init__.py)
        env["GOMP_SPINCOUNT"] = prima_rpc.SHARED_SPIN
    env.setdefault("OMP_NUM_THREADS", str(threads_each(n)))
    env.pop(TOKEN_ENV, None)
    env.update({TOKEN_ENV: token} if token else {})
    ring = LocalRing(addresses, log_dir, env=env, detach=detach)
    for i, port in enumerate(ports):
        store = models[i] if models else model
        cmd = [sys.executable, "-m", "nodes.ring.main", "--host", "127.0.0.1", "--port", str(port),
               "--peer", addresses[(i + 1) % n], "--name", f"node{i}"]
        cmd += ["--model", str(store)] if store else []
        cmd += extra_args[i] if extra_args else []
        if "--prefix-dir" not in cmd:  # the ring's copies of its prefixes beside its logs: its restarts find them
            cmd += ["--prefix-dir", str(log_dir / "prefixes")]
        ring.commands.append(cmd)
        ring.start_node(i, fresh=True)
    try:
        for i, (address, proc) in enumerate(zip(addresses, ring.processes)):
            wait_serving(address, proc, timeout, token, ring.log(f"node{i}"))
    except BaseException:
        ring.stop()
        raise
    return ring


def last_line(log: Path) -> str:
    """The last line of text a process wrote (usually its `error: ...`), without a usage box's frame."""
    try:
        lines = log.read_bytes()[-4096:].decode(errors="replace").splitlines()
    except OSError:
        return ""
    text = [t for t in (line.strip(" │╭╮╰╯─") for line in lines) if any(c.isalnum() for c in t)]
    return text[-1] if text else ""


def wait_serving(address: str, proc: subprocess.Popen, timeout: float, token: str | None = None,
                 log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    where = f"log: {log}" if log else "see its log"
    with Control(address, token, Deadlines(info=1.0)) as peer:  # asked again and again while it starts
        while True:
            if proc.poll() is not None:
                said = last_line(log) if log else ""
                raise LaunchError(f"node {address} exited with status {proc.returncode}"
                                  + (f" saying {said!r}" if said else "") + f" ({where})")
            try:
                peer.info()
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise LaunchError(f"node {address} did not start within {timeout:.0f} s ({where})") from None
                time.sleep(0.2)
