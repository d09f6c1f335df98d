"""Bring a home up on this machine and take it down: groups, namespaces, link shapers and one prima-node each.

A testbed is named by its base port. Device i serves on 127.0.(i+1).1, port base + i: distinct addresses, so
programs that use the same ports on every device (prima.cpp's ranks) run over the same links. Its record is
$PRIMA_HOME/testbed/<base>/state.json (with the logs beside it); sockets and control files live in
/run/prima-tb/<base>/.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil

from prima_rpc.spec.home import prima_home
from tools.testbed import cgroups, netns
from tools.testbed.home import Device, Home, device_from_json

DEFAULT_BASE = 17000
RUN_ROOT = Path("/run/prima-tb")
NETNS_PREFIX = "prima-tb-"
# Nodes on a share of a core run one compute thread; OpenMP's workers spin only briefly (prima_rpc/__init__.py).
NODE_ENV = {"GOMP_SPINCOUNT": "1000", "PYTHONUNBUFFERED": "1"}


class BedError(RuntimeError):
    """What went wrong, in one line for the CLI."""


def state_dir(base: int) -> Path:
    return prima_home() / "testbed" / str(base)


def read_state(base: int) -> dict | None:
    try:
        return json.loads((state_dir(base) / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None, token: str) -> bool:
    try:
        return pid is not None and any(token in part for part in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def pack(devices: tuple[Device, ...], cpus: list[int]) -> tuple[Device, ...]:
    """Pin each device of less than a core that names no cores to one CPU, fullest first, where they fit.

    A fraction of a core spread over two CPUs stalls: the kernel hands a group's quota out per CPU in slices, so
    one thread of the node can wait for the next period while quota sits on the other CPU (a 0.3-core node's PING
    round trip went from 2.2 ms to 4.8). One CPU a device, as a real device's cores are its own, avoids that.
    """
    if any(d.cores for d in devices) or any(d.cpu > 1 for d in devices):
        return devices
    room = {c: 1.0 for c in cpus}
    out = {}
    for d in sorted(devices, key=lambda d: -d.cpu):
        cpu = max(room, key=lambda c: room[c])
        if room[cpu] + 1e-9 < d.cpu:
            return devices  # they do not pack: leave all unpinned rather than some
        room[cpu] -= d.cpu
        out[d.name] = replace(d, cores=(cpu,))
    return tuple(out[d.name] for d in devices)


def layout(home: Home, base: int) -> list[dict]:
    """Each device's addresses, namespace and groups' name."""
    if len(home.devices) > 250:
        raise BedError("at most 250 devices")
    out = []
    for i, d in enumerate(pack(home.devices, sorted(os.sched_getaffinity(0)))):
        port = base + i
        out.append(d.to_json() | {"ip": f"127.0.{i + 1}.1", "port": port, "address": f"127.0.{i + 1}.1:{port}",
                                  "netns": f"{NETNS_PREFIX}{base}-{i}", "group": f"{base}/{d.name}"})
    return out


def up(home: Home, model: Path, *, base: int = DEFAULT_BASE, draft: Path | None = None, allow_unlimited: bool = False,
       fetch: bool = False, node_args: list[str] | None = None, node_env: dict | None = None,
       timeout: float = 120.0,
       say=lambda line: print(line, file=sys.stderr)) -> dict:
    """Start the home; returns the `up --json` record. fetch: only the head has the model, the others fetch their
    windows from it over the links (as in a real home); else every device reads the same store from the disk."""
    existing = read_state(base)
    if existing and any(_alive(d.get("node_pid"), "nodes.ring.main") for d in existing["devices"]):
        raise BedError(f"a testbed is already up on base port {base}; run `python -m tools.testbed down "
                       f"--base-port {base}` first")
    if existing:
        down(base, say=lambda line: None)
    tree = cgroups.Tree.detect()
    disk = cgroups.disk_of(model)
    why = netns.usable()
    if why is not None:
        raise BedError(f"the testbed needs network namespaces (`ip netns`, as root): {why}")
    problems = tree.problems(pack(home.devices, sorted(os.sched_getaffinity(0))), disk)
    for p in problems:
        say(f"cannot enforce {p}")
    hard = [p for p in problems if not p.startswith("disk speed")]
    if hard and not allow_unlimited:
        raise BedError(f"cannot enforce: {hard[0]}; give --allow-unlimited to run without it")
    devices = layout(home, base)
    folder, run = state_dir(base), RUN_ROOT / str(base)
    folder.mkdir(parents=True, exist_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    state = {"base_port": base, "home": home.name, "model": str(model), "run_dir": str(run), "devices": devices,
             "cgroup_v2": tree.v2, "kernel_disk_limit": disk is not None and not hard, "unlimited": problems}
    save(state)
    try:
        for d in devices:
            dev = device_from_json(d | {"memory": str(d["memory_bytes"])}, d["name"])
            groups = cgroups.DeviceGroups(tree, d["group"])
            if not hard:
                groups.create(dev, disk)
            netns.create(d["netns"])
        for i, d in enumerate(devices):
            log = open(folder / f"{d['name']}-link.log", "wb")
            proc = subprocess.Popen([sys.executable, "-m", "tools.testbed.shaper", str(folder / "state.json"), str(i)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=_env(), cwd=_repo_root())
            d["shaper_pid"] = proc.pid
            save(state)
        _wait(lambda: all((run / f"{d['name']}.ready").exists() for d in devices), timeout,
              "the link shapers did not start", folder)
        _evict(model)
        for i, d in enumerate(devices):
            d["node_pid"] = _start_node(state, i, model, draft if i == 0 else None, fetch, node_args or [], hard,
                                        node_env or {})
            save(state)
        from prima_rpc.app.local_ring import wait_serving

        for d in devices:
            wait_serving(d["address"], _Waitable(d["node_pid"]), timeout,
                         log=folder / f"{d['name']}.log")
    except BaseException:
        down(base, say=lambda line: None)
        raise
    return record(state)


class _Waitable:
    """What wait_serving needs of a process it did not start: poll() and returncode."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        try:
            p = psutil.Process(self.pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                return None
        except psutil.NoSuchProcess:
            pass
        self.returncode = -1
        return self.returncode


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _env() -> dict:
    env = dict(os.environ)
    root = _repo_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _start_node(state: dict, i: int, model: Path, draft: Path | None, fetch: bool, extra: list[str],
                unlimited: list[str], extra_env: dict) -> int:
    devices = state["devices"]
    d, nxt = devices[i], devices[(i + 1) % len(devices)]
    folder = state_dir(state["base_port"])
    cmd = [sys.executable, "-m", "nodes.ring.main", "--host", d["ip"], "--port", str(d["port"]),
           "--peer", nxt["address"], "--name", d["name"], "--cache", str(folder / "cache" / d["name"])]
    cmd += ["--model", str(model)] if (i == 0 or not fetch) else []
    cmd += ["--draft", str(draft)] if draft else []
    cmd += extra
    env = _env() | NODE_ENV | extra_env
    env["OMP_NUM_THREADS"] = str(max(1, int(d["cpu"])))
    if not state["kernel_disk_limit"]:  # no kernel throttle: the node paces its own reads
        env["PRIMA_DISK_MBPS"] = str(d["disk_mbps"])
    groups = None if unlimited else cgroups.DeviceGroups(cgroups.Tree.detect(), d["group"])

    def enter() -> None:  # in the child, before exec: its groups and namespace are the node's from its first byte
        if groups is not None:
            groups.join(os.getpid())
        netns.enter(d["netns"])

    with open(folder / f"{d['name']}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, preexec_fn=enter, cwd=_repo_root())
    return proc.pid


def _wait(ready, timeout: float, what: str, folder: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise BedError(f"{what} within {timeout:.0f} s (logs in {folder})")
        time.sleep(0.05)


def _evict(model: Path) -> None:
    """Drop the store's pages from the page cache: each device reads its layers from the disk, at its speed."""
    for f in model.rglob("*"):
        if f.is_file():
            try:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            except OSError:
                pass


def save(state: dict) -> None:
    path = state_dir(state["base_port"]) / "state.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def record(state: dict) -> dict:
    """The `up --json` contract."""
    return {"head": state["devices"][0]["address"],
            "devices": [{"name": d["name"], "address": d["address"], "pid": d.get("node_pid"), "cpu": d["cpu"],
                         "memory_bytes": d["memory_bytes"], "disk_mbps": d["disk_mbps"],
                         "latency_ms": d["latency_ms"], "mbps": d["mbps"]} for d in state["devices"]]}


def _stop(pids: list[int], timeout: float = 10.0) -> None:
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.send_signal(signal.SIGTERM)
            procs.append(p)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=timeout)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)


def down(base: int = DEFAULT_BASE, say=lambda line: print(line, file=sys.stderr)) -> list[str]:
    """Stop the testbed's processes, remove its groups, namespaces, sockets and record; what was removed."""
    state = read_state(base)
    removed = []
    if state is not None:
        nodes = [d["node_pid"] for d in state["devices"] if _alive(d.get("node_pid"), "nodes.ring.main")]
        _stop(nodes)
        shapers = [d["shaper_pid"] for d in state["devices"] if _alive(d.get("shaper_pid"), "tools.testbed")]
        _stop(shapers, timeout=3)
        removed += [f"{len(nodes)} nodes", f"{len(shapers)} link shapers"]
    tree = cgroups.Tree.detect()
    for top in cgroups.leftovers(str(base)):
        for dev in sorted(p for p in top.iterdir() if p.is_dir()):
            cgroups.DeviceGroups(tree, f"{base}/{dev.name}").remove()
            removed.append(f"group {top.parent.parent.name}:{base}/{dev.name}")
        top.rmdir()
    for top in {g.parent for g in cgroups.leftovers("")} | {cgroups.Tree.detect().base(c) / "prima-testbed"
                                                             for c in ("cpu", "memory", "blkio", "cpuset", "unified")}:
        try:
            top.rmdir()  # the testbeds' common parent, once no testbed is left in it
        except OSError:
            pass
    for name in netns.names(f"{NETNS_PREFIX}{base}-"):
        netns.delete(name)
        removed.append(f"namespace {name}")
    shutil.rmtree(RUN_ROOT / str(base), ignore_errors=True)
    if state is not None:
        (state_dir(base) / "state.json").unlink(missing_ok=True)
    for line in removed:
        say(f"removed {line}")
    return removed
