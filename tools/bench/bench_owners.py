"""A device's owner takes its CPU mid-stream: TPOT before, during (without and with the live re-plan), after; the
time from the load's start to the re-plan applied; requests lost; re-plans; greedy outputs unchanged.

    python -m tools.bench.bench_owners [--hog-seconds 120] [--before 30] [--after 60] [--share 0.25]
                                       [--tokens 48] [--memory-hog SIZE] [--json]
    python -m tools.bench.bench_owners --node HEAD:PORT --hog-cmd "COMMAND" [--hog-seconds 120] ...

Without --node: a 3-node loopback SmolLM2 ring (windows 10-10-10), run twice (the head with --replan off, then on);
the owner's load on the middle node is real: its process in a cgroup v1 cpu group at --share of a core (where
/sys/fs/cgroup/cpu is writable), else stopped for (1 - share) of every 200 ms. With --node: an existing ring (the home
testbed's) as it runs, and --hog-cmd started for --hog-seconds (e.g. a busy process in one device's CPU group);
the run is labelled by the head's --replan. 4 clients ask at once throughout; every answer of a prompt must equal
its first (greedy). --memory-hog SIZE adds a row: a process holding SIZE bytes for --hog-seconds, with the device's
PSI memory "some" avg10 (max), swap used and OOM kills (/proc/vmstat) over it.
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from nodes.ring.owner import memory_pressure
from prima_rpc.app import ring
from prima_rpc.app.local_ring import launch
from prima_rpc.client import PrimaClient, Token
from tools.bench.markdown import table
from tools.bench.owner_load import Hog, Slowed
from tools.default_model import ensure_default_store

PROMPTS = ["Write a short story about a robot who learns to paint.", "The capital of France is",
           "Explain why the sky is blue.", "A list of prime numbers: 2, 3,"]


class Load:
    """4 clients asking again and again; every token's arrival time and every answer kept."""

    def __init__(self, head: str, tokens: int, token: str | None = None):
        self.head, self.tokens, self.token = head, tokens, token
        self.stop = threading.Event()
        self.gaps: list[tuple[float, float]] = []  # (when, seconds since the request's previous token)
        self.answers: dict[str, list[list[int]]] = {p: [] for p in PROMPTS}
        self.lost: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._all()), daemon=True)

    async def _one(self, prompt: str) -> None:
        async with PrimaClient(self.head, self.token) as client:
            while not self.stop.is_set():
                ids, last = [], None
                try:
                    async for event in client.generate(prompt, max_tokens=self.tokens):
                        if isinstance(event, Token):
                            now = time.time()
                            if last is not None:
                                self.gaps.append((now, now - last))
                            ids.append(event.token_id)
                            last = now
                    self.answers[prompt].append(ids)
                except Exception as exc:  # a lost request: counted
                    self.lost.append(f"{type(exc).__name__}: {exc}"[:300])

    async def _all(self) -> None:
        await asyncio.gather(*(self._one(p) for p in PROMPTS))

    def tpot_ms(self, start: float, stop: float) -> float | None:
        gaps = [g for t, g in self.gaps if start <= t < stop]
        return statistics.median(gaps) * 1e3 if len(gaps) >= 4 else None

    def greedy_unchanged(self) -> bool:
        return all(all(a == answers[0] for a in answers) for answers in self.answers.values() if answers)


def head_info(head: str, token: str | None):
    return ring.walk(head, token)[0][1]


def wait_watching(head: str, token: str | None, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = head_info(head, token).replan_state
        if state in ("watching", "off"):
            return
        time.sleep(2)
    raise SystemExit(f"error: the head's re-planner did not start watching within {timeout:.0f} s")


def run_event(head: str, token: str | None, args, hog) -> dict:
    """One owner's event on a running ring: before, the load for hog_seconds, after."""
    from prima_rpc.app.applied_plan import predict

    replans_before = len(head_info(head, token).replans)
    predicted_before = predict(head, token)["predicted_tpot_ms"]  # the cost model on the windows now (idle ring)
    load = Load(head, args.tokens, token)
    load.thread.start()
    time.sleep(args.before)
    t_hog = time.time()
    pressure, swap0, oom0, predicted_new = [], psutil.swap_memory().used, oom_kills(), None
    with hog():
        while time.time() < t_hog + args.hog_seconds:
            time.sleep(1)
            pressure.append(memory_pressure() or 0.0)
            info = head_info(head, token)
            if predicted_new is None and len(info.replans) > replans_before:
                predicted_new = info.predicted_tpot_ms  # the new plan's, as the head applied it
    t_end = time.time()
    time.sleep(args.after)
    load.stop.set()
    load.thread.join(600)
    info = head_info(head, token)
    replans = [r for r in info.replans[replans_before:]]
    during = [r for r in replans if t_hog <= r.at <= t_end]
    applied = during[0].at if during else None
    before, adapted = load.tpot_ms(0, t_hog), load.tpot_ms(applied + 2, t_end) if applied else None
    # the cost model's error on this ring (measured / predicted before the load) carried over to the new plan
    vs_new = (adapted / predicted_new) / (before / predicted_before) - 1 if adapted and predicted_new and before \
        else None
    return {
        "replan": info.replan, "tpot_before_ms": before,
        "tpot_during_ms": load.tpot_ms(t_hog, t_end),
        "tpot_during_adapted_ms": adapted,
        "tpot_first_30s_ms": load.tpot_ms(t_hog + 20, t_hog + 30),
        "tpot_after_ms": load.tpot_ms(t_end + args.after / 2, t_end + args.after),
        "hog_to_replan_s": applied - t_hog if applied else None,
        "predicted_tpot_before_ms": predicted_before or None, "predicted_tpot_new_ms": predicted_new or None,
        "adapted_vs_new_prediction": vs_new,
        "replans_during": len(during), "replans": len(replans), "lost": len(load.lost), "lost_why": load.lost[:3],
        "greedy_unchanged": load.greedy_unchanged(), "answers": sum(map(len, load.answers.values())),
        "psi_some_avg10_max": max(pressure, default=0.0), "swap_growth_bytes": psutil.swap_memory().used - swap0,
        "oom_kills": oom_kills() - oom0,
    }


def oom_kills() -> int:
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory_hog(size: int) -> list[str]:
    code = (f"import time\nb = bytearray({size})\nfor i in range(0, len(b), 4096): b[i] = 1\n"
            "time.sleep(1e9)\n")
    return [sys.executable, "-c", code]


def own_ring(args, replan: str, hog_kind: str) -> dict:
    """A loopback ring of 3 (the head with --replan `replan`), its middle node loaded."""
    store = ensure_default_store()
    with tempfile.TemporaryDirectory() as logs:
        extra = [["--replan", replan], [], []]
        local = launch(store, 3, log_dir=Path(logs), detach=False, extra_args=extra)
        try:
            head = local.addresses[0]
            ring.start(head, [10, 10, 10])
            wait_watching(head, None)
            pid = local.processes[1].pid
            hog = ((lambda: Slowed(pid, args.share, args.how, tag="bench")) if hog_kind == "cpu"
                   else (lambda: Hog(memory_hog(args.memory_hog))))
            return run_event(head, None, args, hog)
        finally:
            local.stop()


def rows(results: dict[str, dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    out = []
    for name, r in results.items():
        out.append([name, ms(r["tpot_before_ms"]), ms(r["tpot_during_ms"]), ms(r["tpot_during_adapted_ms"]),
                    ms(r["tpot_first_30s_ms"]), ms(r["tpot_after_ms"]), ms(r["hog_to_replan_s"]),
                    "-" if r["adapted_vs_new_prediction"] is None else f"{r['adapted_vs_new_prediction'] * 100:+.0f} %",
                    r["replans_during"], r["replans"], r["lost"],
                    "yes" if r["greedy_unchanged"] else "NO", f"{r['psi_some_avg10_max']:.1f}",
                    f"{r['swap_growth_bytes'] / 2**20:.0f}", r["oom_kills"]])
    return table(["run", "TPOT before ms", "during ms", "during, re-planned ms", "20-30 s in ms", "after ms",
                  "load to re-plan s", "re-planned vs new plan", "re-plans (event)", "re-plans (all)", "lost",
                  "greedy same", "PSI some max %", "swap MiB", "OOM"], out, right=range(1, 15))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node", help="the head of an existing ring (default: a loopback ring of 3 this bench starts)")
    p.add_argument("--hog-cmd", help="with --node: the command that loads one device (run for --hog-seconds)")
    p.add_argument("--hog-seconds", type=float, default=120.0)
    p.add_argument("--before", type=float, default=30.0, help="seconds of load before the owner's")
    p.add_argument("--after", type=float, default=60.0, help="seconds after the owner's load stops")
    p.add_argument("--share", type=float, default=0.25, help="(loopback) the share of a core the node keeps")
    p.add_argument("--how", choices=("auto", "cgroup", "duty"), default="auto",
                   help="(loopback) a cgroup v1 cpu group, a SIGSTOP duty cycle, or a group where one can be made")
    p.add_argument("--tokens", type=int, default=48, help="max_tokens of each request")
    p.add_argument("--memory-hog", default="0", help="(loopback) a memory hog row: bytes it holds, e.g. 4GiB")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from nodes.ring.main import parse_size

    args.memory_hog = parse_size(args.memory_hog)
    results = {}
    if args.node:
        if not args.hog_cmd:
            p.error("--node needs --hog-cmd (what loads one of its devices)")
        wait_watching(args.node, None)
        r = run_event(args.node, None, args, lambda: Hog(args.hog_cmd))
        results[f"CPU hog, replan {'on' if r['replan'] else 'off'}"] = r
    else:
        for replan in ("off", "on"):
            results[f"CPU hog, replan {replan}"] = own_ring(args, replan, "cpu")
        if args.memory_hog:
            for replan in ("off", "on"):
                results[f"memory hog, replan {replan}"] = own_ring(args, replan, "memory")
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(rows(results))


if __name__ == "__main__":
    main()
