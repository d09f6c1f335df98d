"""An owner's load on one device, for real: the tests and bench_owners slow one node's process down mid-stream.

- `CpuGroup`: a cgroup v1 cpu group (/sys/fs/cgroup/cpu/prima-owners-<tag>-<pid>/) holding the node; its quota
  (cpu.cfs_quota_us) is the device's share of the cores. Needs a writable /sys/fs/cgroup/cpu (`CpuGroup.usable`).
- `DutyCycle`: where no cgroup can be made, the node's process is stopped (SIGSTOP) for the part of every 200 ms that
  the owner takes, and continued (SIGCONT) for the rest: the same share, by the scheduler's hand instead of CFS's.
- `Hog`: a real busy process (`--hog-cmd`, or `busy_loops`): put in a node's group it takes its share of the group.

Each is lifted, and the group removed, on the way out of its `with` (always, even on an error).
"""

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


class CpuGroup:
    """A cgroup v1 cpu group for one process; `share` of one core (0.25: a quarter), None: unlimited."""

    def __init__(self, tag: str, root: Path = CPU_ROOT):
        self.root = root
        self.path = root / f"prima-owners-{tag}-{os.getpid()}"

    @staticmethod
    def usable(root: Path = CPU_ROOT) -> str:
        """"" when groups can be made under root, else why not."""
        if not (root / "cgroup.procs").exists():
            return f"no cgroup v1 cpu controller at {root}"
        if not os.access(root, os.W_OK):
            return f"{root} is not writable (run as root, or delegate the cpu controller)"
        return ""

    def __enter__(self) -> "CpuGroup":
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        return self

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def limit(self, share: float | None) -> None:
        (self.path / "cpu.cfs_quota_us").write_text("-1" if share is None else str(max(1000, int(share * PERIOD_US))))

    def __exit__(self, *exc) -> None:
        """Lift the quota, move every process back to the root group, remove the group."""
        try:
            self.limit(None)
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (self.root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # it ended meanwhile
        finally:
            self.path.rmdir()


class DutyCycle:
    """Stop `pid` for (1 - share) of every `period_s`, from a thread, until the `with` ends (then it runs on)."""

    def __init__(self, pid: int, share: float, period_s: float = 0.2):
        if not 0 < share < 1:
            raise ValueError(f"share must be in (0, 1), got {share}")
        self.pid, self.share, self.period_s = pid, share, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duty-cycle", daemon=True)

    def __enter__(self) -> "DutyCycle":
        self._thread.start()
        return self

    def _run(self) -> None:
        on, off = self.share * self.period_s, (1 - self.share) * self.period_s
        try:
            while not self._stop.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(off)
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(on)
        except ProcessLookupError:
            pass
        finally:
            _continue(self.pid)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        _continue(self.pid)


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def busy_loops(n: int) -> list[str]:
    """A command of n processes spinning on the CPU until killed (the default hog)."""
    code = ("import multiprocessing as m\ndef spin():\n    while True: pass\n"
            f"ps = [m.Process(target=spin) for _ in range({n})]\n[p.start() for p in ps]\n[p.join() for p in ps]\n")
    return [sys.executable, "-c", code]


class Hog:
    """A real process loading the CPU (`command`, a string for a shell-less split or a list), stopped on exit."""

    def __init__(self, command: str | list[str]):
        self.command = shlex.split(command) if isinstance(command, str) else command
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Hog":
        self.proc = subprocess.Popen(self.command, start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: it and its children, nothing else
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Slowed:
    """One node's process at `share` of a core while inside: its own cgroup when one can be made ("cgroup"), else
    a duty cycle of SIGSTOP / SIGCONT ("duty"). `how`: "cgroup", "duty" or "auto"."""

    def __init__(self, pid: int, share: float, how: str = "auto", tag: str = "node"):
        why = CpuGroup.usable()
        if how == "cgroup" and why:
            raise OSError(why)
        self.how = "cgroup" if how == "cgroup" or (how == "auto" and not why) else "duty"
        self.pid, self.share, self.tag = pid, share, tag
        self._inner = None

    def __enter__(self) -> "Slowed":
        if self.how == "cgroup":
            group = CpuGroup(self.tag).__enter__()
            try:
                group.add(self.pid)
                group.limit(self.share)
            except BaseException:
                group.__exit__(None, None, None)
                raise
            self._inner = group
        else:
            self._inner = DutyCycle(self.pid, self.share).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._inner.__exit__(*exc)
