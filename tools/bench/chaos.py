"""The chaos soak: a loopback ring (4 prima-node processes) under 4 HTTP clients running a mix of requests through
`prima-ctl serve`, while a seeded schedule does one fault every A-B seconds (SIGKILL of a worker, the head or the
standby; SIGSTOP of a node for 5-30 s; a node joining; a member leaving; a node restarted with its store; a `start`
with a new plan). Every answer is compared with the single-process reference (the same request to a 1-node ring);
a request refused with a clear retriable error is retried once. At the end the ring must be healthy and no node's
RSS or open fds may have grown more than 10 % since the warm-up.

    python -m tools.bench.chaos --minutes 20 --seed 1 [--every 20-60] [--faults N] [--model smollm2|tiny|DIR] [--json]

It exits 1 when a request was lost (neither completed nor completed by its one retry), the ring ended unhealthy,
or a resource grew more than 10 %.
"""

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from tools.bench import chaos_checks
from tools.bench.chaos_faults import FAULTS, choose
from tools.bench.chaos_load import MIX, send
from tools.bench.chaos_ring import ChaosRing
from tools.bench.chaos_serve import references, serve_subprocess

GROWTH_LIMIT = 0.10
RETRY_SETTLE_S = 45.0  # how long a client waits for the ring to settle before its one retry


class Load:
    """4 client threads running the mix until `until`; what each request came to."""

    def __init__(self, root: str, expected: dict[str, str], chaos: ChaosRing, clients: int):
        self.root, self.expected, self.chaos = root, expected, chaos
        self.lock = threading.Lock()
        self.requests = self.completed = self.refused = self.retried = 0
        self.lost: list[str] = []
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []
        self.longest_stall_s = 0.0
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True, name=f"client{i}")
                        for i in range(clients)]
        self.until = 0.0

    def start(self, until: float) -> None:
        self.until = until
        for t in self.threads:
            t.start()

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(max(1.0, timeout))

    def _client(self, i: int) -> None:
        names = list(MIX)
        k = i
        while time.monotonic() < self.until:
            self._one(names[k % len(names)])
            k += 1

    def _one(self, name: str) -> None:
        first = send(self.root, name)
        tries = [first]
        if first.kind == "refused":
            chaos_checks.wait_for_head(self.chaos, RETRY_SETTLE_S)
            tries.append(send(self.root, name))
        last = tries[-1]
        with self.lock:
            self.requests += 1
            self.refused += first.kind == "refused"
            for t in tries:
                if t.ttft_s is not None:
                    self.ttft_s.append(t.ttft_s)
                if len(t.token_times) > 1:
                    gaps = [b - a for a, b in zip(t.token_times, t.token_times[1:])]
                    self.tpot_s.append((t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1))
                    self.longest_stall_s = max(self.longest_stall_s, max(gaps))
            if last.kind == "ok" and last.answer == self.expected[name]:
                self.completed += 1
                self.retried += len(tries) > 1
            else:
                why = last.why if last.kind != "ok" else \
                    f"differs from the reference: {last.answer[:300]} (reference: {self.expected[name][:300]})"
                self.lost.append(f"{name}: {' then '.join(t.kind for t in tries)}: {why}")


def store_of(model: str, work: Path) -> Path:
    if model == "tiny":
        from tools.synth import synth

        return synth(work / "tiny", "tiny", seed=1)
    if model == "smollm2":
        from tools.default_model import ensure_default_store

        return ensure_default_store()
    return Path(model)


def run(minutes: float, seed: int, every: tuple[float, float], max_faults: int | None, model: str, nodes: int,
        clients: int, work: Path, say=print) -> dict:
    store = store_of(model, work)
    say(f"references: each of the {len(MIX)} requests on a 1-node ring of {store.name}")
    expected = references(store, work / "reference")
    testbed = False  # python -m tools.testbed registers its kinds (link cut, latency spike, memory hog) where it runs
    skipped = [f.kind for f in FAULTS if f.testbed and not testbed]
    faults = [f for f in FAULTS if not f.testbed or testbed]
    if skipped:
        say(f"no home testbed here: skipping {', '.join(skipped)} (loopback ring)")
    chaos = ChaosRing(store, nodes, work / "ring")
    serve = None
    try:
        n_layers = chaos.info(chaos.local.addresses[0]).n_layers
        from prima_rpc.app import ring

        ring.start(chaos.local.addresses[0], chaos_checks.even_windows(n_layers, nodes))
        serve, root = serve_subprocess(chaos, work / "ring" / "logs" / "serve.log")
        say(f"warm-up: the mix once through prima-ctl serve at {root}")
        for name in MIX:
            outcome = send(root, name)
            if outcome.kind != "ok" or outcome.answer != expected[name]:
                raise RuntimeError(f"warm-up {name}: {outcome.kind} {outcome.why or outcome.answer[:200]}")
        before = {**chaos.resources(), "serve": chaos_checks.process_resources(serve)}
        disk_before = chaos.disk_bytes()
        load = Load(root, expected, chaos, clients)
        rng = random.Random(seed)
        started = time.monotonic()
        end = started + minutes * 60
        load.start(end)
        done, log = _faults_until(end, started, rng, every, max_faults, faults, chaos, say)
        chaos.continue_due(float("inf"))
        load.join(end + 300 - time.monotonic())
        health = chaos_checks.healthy(chaos, root, expected)
        after = {**chaos.resources(), "serve": chaos_checks.process_resources(serve)}
        disk_after = chaos.disk_bytes()
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait(15)
        chaos.close()
    rss, fds = chaos_checks.growth(before, after)
    return {"requests": load.requests, "completed": load.completed, "refused": load.refused, "retried": load.retried,
            "lost": load.requests - load.completed, "faults": done, "rss_growth": round(rss, 4),
            "fd_growth": round(fds, 4), "healthy": health["healthy"],
            "p99_tpot_ms": round(chaos_checks.percentile(load.tpot_s, 99) * 1000, 1),
            "_detail": {"lost": load.lost, "health": health, "faults": log, "skipped": skipped,
                        "ttft_ms": [round(chaos_checks.percentile(load.ttft_s, q) * 1000, 1) for q in (50, 99)],
                        "tpot_ms": [round(chaos_checks.percentile(load.tpot_s, q) * 1000, 1) for q in (50, 99)],
                        "longest_stall_s": round(load.longest_stall_s, 2), "before": before, "after": after,
                        "disk": [disk_before, disk_after], "minutes": minutes, "seed": seed}}


def _faults_until(end: float, started: float, rng: random.Random, every: tuple[float, float],
                  max_faults: int | None, faults: list, chaos: ChaosRing, say) -> tuple[dict[str, int], list[str]]:
    """The seeded schedule: a fault every A-B s until `end` (or max_faults); (faults done by kind, their lines)."""
    done: dict[str, int] = {}
    log: list[str] = []
    next_at = started + rng.uniform(*every)
    while time.monotonic() < end:
        chaos.continue_due()
        if time.monotonic() >= next_at and (max_faults is None or sum(done.values()) < max_faults):
            next_at += rng.uniform(*every)  # from this fault's start: a slow fault does not thin the schedule
            try:
                kind, what = choose(faults, chaos, rng, every[1])
            except Exception as exc:  # the ring mid-change refused a look at it: the fault is not done
                kind, what = "", f"{type(exc).__name__}: {exc}"
            line = f"{time.monotonic() - started:6.1f} s  {kind or 'no fault'}: {what}"
            say(line)
            log.append(line)
            if kind:
                done[kind] = done.get(kind, 0) + 1
        time.sleep(0.2)
    return done, log


def passed(result: dict) -> bool:
    return (result["lost"] == 0 and result["healthy"] and result["rss_growth"] <= GROWTH_LIMIT
            and result["fd_growth"] <= GROWTH_LIMIT)


def table(result: dict) -> str:
    d = result["_detail"]
    rows = [("requests", result["requests"]), ("completed", result["completed"]),
            ("refused (clear, retriable)", result["refused"]), ("retried and completed", result["retried"]),
            ("lost", result["lost"]),
            ("faults", ", ".join(f"{k} {v}" for k, v in sorted(result["faults"].items())) or "none"),
            ("skipped kinds", ", ".join(d["skipped"]) or "none"),
            ("TTFT p50 / p99 ms (streamed, under faults)", "{} / {}".format(*d["ttft_ms"])),
            ("TPOT p50 / p99 ms (streamed, under faults)", "{} / {}".format(*d["tpot_ms"])),
            ("longest stall between tokens s", d["longest_stall_s"]),
            ("anonymous RSS growth beyond weights (worst process)", f"{result['rss_growth']:+.1%}"),
            ("open fds growth (worst process)", f"{result['fd_growth']:+.1%}"),
            ("disk MiB start / end", f"{d['disk'][0] / 2**20:.1f} / {d['disk'][1] / 2**20:.1f}"),
            ("healthy at the end", result["healthy"])]
    for name, start in sorted(d["before"].items()):
        end = d["after"].get(name)
        same = end is not None and end[0] == start[0]
        shown = [f"{r[1] / 2**20:.0f} / {r[3] / 2**20:.0f}, {r[2]}" for r in (start, end) if r is not None]
        rows.append((f"{name} anon RSS / weights MiB, fds",
                     f"{shown[0]} -> {shown[1] if same else 'restarted or gone'}"))
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    out += [f"health: {k}: {v}" for k, v in d["health"].items() if k != "healthy"]
    out += [f"lost: {why}" for why in d["lost"][:20]]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", default="20-60", help="seconds between faults: A-B, drawn by the seed")
    parser.add_argument("--faults", type=int, default=None, help="at most this many faults")
    parser.add_argument("--model", default="smollm2", help="smollm2 (the default store), tiny (synthetic: light, but "
                        "its near-uniform logits may flip greedy ties), or a store directory")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    a, _, b = args.every.partition("-")
    every = (float(a), float(b or a))
    with tempfile.TemporaryDirectory(prefix="chaos-") as work:
        result = run(args.minutes, args.seed, every, args.faults, args.model, args.nodes, args.clients, Path(work),
                     say=(lambda line: print(line, file=sys.stderr, flush=True)))
    if args.json:  # the table goes to stderr: what a failed run lost, and why
        print(table(result), file=sys.stderr)
        print(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}))
    else:
        print(table(result))
    sys.exit(0 if passed(result) else 1)


if __name__ == "__main__":
    main()
