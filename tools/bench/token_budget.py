"""Per-token time budget of each node of a local loopback ring: where a decode token's milliseconds go (compute,
hand-offs to and from the compute thread, frame decode and encode, gRPC sends, inbox waits), side by side for
node settings compared in one run.

    python -m tools.bench.token_budget [--dtype int4] [--windows 10 10 10] [--tokens 64] [--repeats 3]
        [--variant "thread=--inline-ms 0" --variant "inline=" --variant "t1=OMP_NUM_THREADS=1"]

Each variant is its own ring of real prima-node processes on 127.0.0.1 (all up at once, requests interleaved
across them, so a busy spell of a shared machine hits every variant alike). The figures are the nodes' own spans
(nodes/ring/spans.py, scraped from their --metrics-port before and after the measured requests) divided by the
tokens generated: prefill included, so a token's share of it too. "rest of the ring" is the time between a
node's sends and its next receive: the other nodes, the wire and wake-ups.
"""

import argparse
import asyncio
import os
import re
import shlex
import statistics
import tempfile
import urllib.request
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from prima_rpc.app import ring
from prima_rpc.app.local_ring import LaunchError, LocalRing, free_ports, launch
from tools.bench.bench_ring import ring_run
from tools.bench.markdown import table
from tools.default_model import ensure_default_store

# Span name (nodes/ring/spans.py; compute pool jobs as FUNCTION.wait/run/back/inline) -> budget line.
PARTS = {"Shard.compute_batch": "layers", "Shard.embed": "embedding", "Shard.logits": "logits",
         "Shard.last_logits": "logits"}
ENV = re.compile(r"[A-Z][A-Z0-9_]*")  # a variant's NAME=VALUE word with such a NAME sets the nodes' environment
CPU_LINE = "layers: thread CPU time"  # of the layers' wall time above: not a part of the token's sum
LINES = ["layers", CPU_LINE, "embedding", "logits", "hand-off to compute thread", "hand-off back to loop",
         "receive + decode", "encode", "send", "inbox wait"]


def budget_line(span: str) -> str | None:
    fn, _, part = span.rpartition(".")
    if part in ("run", "inline"):
        return PARTS.get(fn)
    if part == "cpu" and PARTS.get(fn) == "layers":
        return CPU_LINE
    if part == "wait" and fn in PARTS:
        return "hand-off to compute thread"
    if part == "back" and fn in PARTS:
        return "hand-off back to loop"
    return {"receive": "receive + decode", "encode": "encode", "send": "send", "inbox": "inbox wait"}.get(span)


def metrics_ports(n: int, start: int) -> list[int]:
    """n free ports from `start` on, below the kernel's ephemeral range: the nodes' own ports never take them."""
    for base in range(start, 30000, 50):
        try:
            return free_ports(n, base)
        except LaunchError:
            continue
    raise LaunchError("no free metrics ports in 21000-30000")


def scrape(port: int) -> dict[str, float]:
    """span -> seconds so far, of the node serving metrics on `port`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.labels["span"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "prima_span_seconds" for s in fam.samples if s.name.endswith("_total")}


class Variant:
    """One ring of the comparison: its nodes' extra flags, metrics ports and what was measured."""

    def __init__(self, index: int, name: str, flags: list[str]):
        self.index, self.name, self.flags = index, name, flags
        self.ring: LocalRing | None = None
        self.ports: list[int] = []
        self.tpots: list[float] = []
        self.seconds: list[dict[str, float]] = []  # per node: budget line -> seconds over measured requests
        self.tokens = 0

    def start(self, store: Path, windows: list[int], logs: Path) -> None:
        self.ports = metrics_ports(len(windows), 21000 + 500 * self.index)
        env = dict(f.split("=", 1) for f in self.flags if ENV.fullmatch(f.split("=", 1)[0]))
        flags = [f for f in self.flags if not ENV.fullmatch(f.split("=", 1)[0])]
        extra = [["--metrics-port", str(p), *flags] for p in self.ports]
        saved = dict(os.environ)
        os.environ.update(env)  # the nodes' environment (launch passes its own on)
        try:
            self.ring = launch(store, len(windows), log_dir=logs / self.name, extra_args=extra, detach=False)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        ring.start(self.ring.addresses[0], windows)
        asyncio.run(ring_run(self.ring.addresses[0], 8))  # warm-up: the kinds of jobs are measured once
        self.seconds = [defaultdict(float) for _ in windows]

    def measure(self, tokens: int) -> None:
        before = [scrape(p) for p in self.ports]
        done = asyncio.run(ring_run(self.ring.addresses[0], tokens))
        after = [scrape(p) for p in self.ports]
        self.tpots.append(done.tpot_ms)
        self.tokens += done.completion_tokens
        for acc, b, a in zip(self.seconds, before, after, strict=True):
            for span, value in a.items():
                line = budget_line(span)
                if line:
                    acc[line] += value - b.get(span, 0.0)

    def rows(self) -> list[list[str]]:
        """Budget lines of every node in ms a token, then the rest of the ring and the TPOT."""
        tpot = statistics.median(self.tpots)
        per = [{k: v * 1e3 / self.tokens for k, v in node.items()} for node in self.seconds]
        out = [[line, *(f"{p.get(line, 0.0):.2f}" for p in per)] for line in LINES]
        rest = [max(tpot - sum(v for k, v in p.items() if k != CPU_LINE), 0.0) for p in per]
        out.append(["rest of the ring", *(f"{r:.2f}" for r in rest)])
        out.append(["TPOT (median)", *(f"{tpot:.2f}" for _ in per)])
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="int4", help="the default model's store: int4 (its Q4_1 blocks), int8, float32")
    p.add_argument("--windows", type=int, nargs="+", default=[10, 10, 10])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variant", action="append", metavar="NAME=FLAGS",
                   help="a ring whose nodes get FLAGS, prima-node options and VAR=VALUE environment settings, e.g. "
                        "'t1=OMP_NUM_THREADS=1' (default: thread=--inline-ms 0 and inline=)")
    args = p.parse_args()
    specs = args.variant or ["thread=--inline-ms 0", "inline="]
    parts = [s.partition("=") for s in specs]
    variants = [Variant(i, name, shlex.split(flags)) for i, (name, _, flags) in enumerate(parts)]
    store = ensure_default_store(dtype=None if args.dtype == "float32" else args.dtype)
    with tempfile.TemporaryDirectory() as logs:
        try:
            for v in variants:
                v.start(store, args.windows, Path(logs))
            for _ in range(args.repeats):
                for v in variants:
                    v.measure(args.tokens)
        finally:
            for v in variants:
                if v.ring is not None:
                    v.ring.stop()
    k = 30 // sum(args.windows)
    print(f"SmolLM2-135M-Instruct {args.dtype} store, windows {args.windows} (k={k}), {args.tokens} tokens, "
          f"{args.repeats} runs interleaved; ms a token")
    nodes = [f"node{i}" + (" (head)" if i == 0 else "") for i in range(len(args.windows))]
    for v in variants:
        print(f"\n{v.name} ({' '.join(v.flags) or 'defaults'}): TPOT runs {[round(t, 1) for t in v.tpots]}")
        print(table(["ms / token", *nodes], v.rows(), right=range(1, len(nodes) + 1)))


if __name__ == "__main__":
    main()
