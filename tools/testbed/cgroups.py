"""A device's limits as kernel control groups: CPU quota (and pinned cores), memory that counts page cache, and
read throttling of the store's disk. cgroup v1 (a controller a hierarchy) or v2 (one unified tree), whichever the
machine has.

Each device gets one group per controller with two children in the CPU tree: `node` (the prima-node) and `owner`
(what `testbed load` runs, the device owner's apps), so an owner's load takes its share of the device's quota,
not of the machine's. Memory and disk limits hold both together, as on a real device.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from tools.testbed.home import Device

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # a short CFS period: a fraction of a core runs as a slower core, not 100 ms bursts
MIN_QUOTA_US = 1_000  # the kernel's least quota
OWNER_WEIGHT = 1024  # cpu.shares of `node`; an owner's load sets its own against it
# The testbed's devices get their quotas even while other programs load the machine: each device is a machine of
# its own, which nothing outside it slows (the quotas still cap them).
TESTBED_WEIGHT = 65536


class LimitError(RuntimeError):
    """A limit that cannot be set; the message names it."""


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise LimitError(f"cannot write {value!r} to {path}: {exc.strerror}") from None


def disk_of(path: Path) -> str | None:
    """'MAJOR:MINOR' of the whole disk holding `path`, or None where it is no block device (overlay, tmpfs)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:
        return None
    sysfs = Path(f"/sys/dev/block/{major}:{minor}")
    if (sysfs / "partition").exists():  # throttling names the whole disk
        parent = sysfs.resolve().parent / "dev"
        return parent.read_text().strip() if parent.exists() else None
    return f"{major}:{minor}" if sysfs.exists() else None


@dataclass(frozen=True)
class Tree:
    """Where the groups live: v1's per-controller hierarchies, or v2's unified one."""

    v2: bool

    @classmethod
    def detect(cls) -> Tree:
        return cls(v2=(ROOT / "cgroup.controllers").exists())

    def base(self, controller: str) -> Path:
        return ROOT if self.v2 else ROOT / controller

    def problems(self, devices: tuple[Device, ...], disk: str | None) -> list[str]:
        """One line per limit this machine cannot enforce (empty: all of them)."""
        out = []
        if self.v2:
            have = set((ROOT / "cgroup.controllers").read_text().split())
            wanted = {"cpu": "CPU share", "memory": "RAM", "io": "disk speed", "cpuset": "pinned cores"}
            for ctl, what in wanted.items():
                if ctl == "cpuset" and not any(d.cores for d in devices):
                    continue
                if ctl not in have:
                    out.append(f"{what}: the cgroup v2 controller {ctl!r} is not enabled")
            if not os.access(ROOT, os.W_OK):
                out.append(f"every limit: {ROOT} is not writable (run as root)")
        else:
            wanted = {"cpu": "CPU share", "memory": "RAM", "blkio": "disk speed", "cpuset": "pinned cores"}
            for ctl, what in wanted.items():
                if ctl == "cpuset" and not any(d.cores for d in devices):
                    continue
                if not (ROOT / ctl).is_dir() or not os.access(ROOT / ctl, os.W_OK):
                    out.append(f"{what}: {ROOT / ctl} is missing or not writable (run as root)")
        if disk is None:
            out.append("disk speed: the store's filesystem is no block device the kernel can throttle "
                       "(the nodes pace their own reads instead, $PRIMA_DISK_MBPS)")
        return out


@dataclass(frozen=True)
class DeviceGroups:
    """One device's groups; `name` is '<testbed>/<device>' under each controller's prima-testbed/."""

    tree: Tree
    name: str

    def path(self, controller: str, child: str = "") -> Path:
        p = self.tree.base(controller) / "prima-testbed" / self.name
        return p / child if child else p

    def controllers(self) -> list[str]:
        return ["unified"] if self.tree.v2 else ["cpu", "memory", "blkio", "cpuset"]

    def create(self, device: Device, disk: str | None) -> None:
        if self.tree.v2:
            self._create_v2(device, disk)
        else:
            self._create_v1(device, disk)

    def _create_v1(self, device: Device, disk: str | None) -> None:
        for ctl in self.controllers():
            self.path(ctl).mkdir(parents=True, exist_ok=True)
        if device.cores:  # a cpuset group needs its cpus and mems set at every level before a task can join
            cpus = ",".join(map(str, device.cores))
            mems = (ROOT / "cpuset" / "cpuset.mems").read_text().strip()
            for level in (self.path("cpuset").parent.parent, self.path("cpuset").parent, self.path("cpuset")):
                if level == self.path("cpuset"):
                    _write(level / "cpuset.cpus", cpus)
                else:
                    _write(level / "cpuset.cpus", (ROOT / "cpuset" / "cpuset.cpus").read_text().strip())
                _write(level / "cpuset.mems", mems)
        cpu = self.path("cpu")
        for level in (cpu.parent.parent, cpu.parent):
            _write(level / "cpu.shares", str(TESTBED_WEIGHT))
        _write(cpu / "cpu.cfs_period_us", str(PERIOD_US))
        _write(cpu / "cpu.cfs_quota_us", str(max(MIN_QUOTA_US, round(device.cpu * PERIOD_US))))
        for child in ("node", "owner"):
            (cpu / child).mkdir(exist_ok=True)
        _write(cpu / "node" / "cpu.shares", str(OWNER_WEIGHT))
        _write(self.path("memory") / "memory.limit_in_bytes", str(device.memory_bytes))
        if disk is not None:
            _write(self.path("blkio") / "blkio.throttle.read_bps_device", f"{disk} {int(device.disk_mbps * 1e6)}")

    def _create_v2(self, device: Device, disk: str | None) -> None:
        top = self.tree.base("unified") / "prima-testbed"
        top.mkdir(exist_ok=True)
        for ctl in ("cpu", "memory", "io", "cpuset"):  # let the children be limited
            for level in (ROOT, top, self.path("unified")):
                level.mkdir(exist_ok=True)
                try:
                    (level / "cgroup.subtree_control").write_text(f"+{ctl}")
                except OSError:
                    pass
        g = self.path("unified")
        _write(g.parent / "cpu.weight", str(TESTBED_WEIGHT * 10000 // 262144))
        _write(g / "cpu.max", f"{max(MIN_QUOTA_US, round(device.cpu * PERIOD_US))} {PERIOD_US}")
        _write(g / "memory.max", str(device.memory_bytes))
        if disk is not None:
            _write(g / "io.max", f"{disk} rbps={int(device.disk_mbps * 1e6)}")
        if device.cores:
            _write(g / "cpuset.cpus", ",".join(map(str, device.cores)))
        for child in ("node", "owner"):
            (g / child).mkdir(exist_ok=True)

    def join(self, pid: int, role: str = "node") -> None:
        """Put pid (a node or an owner's load) in this device's groups."""
        if self.tree.v2:
            _write(self.path("unified", role) / "cgroup.procs", str(pid))
            return
        for ctl in self.controllers():
            if ctl == "cpuset" and not (self.path(ctl) / "cpuset.cpus").read_text().strip():
                continue
            _write((self.path(ctl, role) if ctl == "cpu" else self.path(ctl)) / "cgroup.procs", str(pid))

    def set_owner_share(self, fraction: float) -> None:
        """When node and owner both want the CPU, the owner gets `fraction` of the device's quota."""
        weight = max(2, round(OWNER_WEIGHT * fraction / max(1e-6, 1 - fraction)))
        if self.tree.v2:
            _write(self.path("unified", "node") / "cpu.weight", "100")
            _write(self.path("unified", "owner") / "cpu.weight", str(max(1, min(10000, round(weight / 10.24)))))
        else:
            _write(self.path("cpu", "owner") / "cpu.shares", str(weight))

    def pids(self) -> set[int]:
        out: set[int] = set()
        for ctl in self.controllers():
            for procs in self.path(ctl).rglob("cgroup.procs"):
                try:
                    out.update(int(x) for x in procs.read_text().split())
                except OSError:
                    pass
        return out

    def memory_usage(self) -> dict:
        """{"usage", "peak", "limit"} bytes of the device's memory group (page cache counted)."""
        if self.tree.v2:
            g = self.path("unified")
            read = lambda f: int((g / f).read_text().split()[0]) if (g / f).exists() else 0  # noqa: E731
            limit = (g / "memory.max").read_text().strip()
            return {"usage": read("memory.current"), "peak": read("memory.peak"),
                    "limit": int(limit) if limit.isdigit() else 0}
        g = self.path("memory")
        return {k: int((g / f"memory.{f}").read_text()) for k, f in
                (("usage", "usage_in_bytes"), ("peak", "max_usage_in_bytes"), ("limit", "limit_in_bytes"))}

    def remove(self, timeout: float = 5.0) -> None:
        """Kill what is left inside, then remove the groups, children first."""
        deadline = time.monotonic() + timeout
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for ctl in self.controllers():
            top = self.path(ctl)
            for g in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                try:
                    g.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise LimitError(f"cannot remove {g}: {exc.strerror}") from None


def leftovers(prefix: str) -> list[Path]:
    """Groups of testbeds named prefix* still present (prefix: the testbed's name, e.g. '17000')."""
    tree = Tree.detect()
    bases = [tree.base("unified")] if tree.v2 else [tree.base(c) for c in ("cpu", "memory", "blkio", "cpuset")]
    return [g for b in bases for g in sorted((b / "prima-testbed").glob(f"{prefix}*")) if g.is_dir()]
