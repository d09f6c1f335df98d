"""Generated hostile requests (hypothesis) to every dialect of the HTTP API in front of a real 2-node ring of a
synthetic store: counts the answers by status, every 5xx and every request the server dropped, then checks that
the ring still answers a reference request with its tokens.

    python -m tools.bench.fuzz_http --requests 10000 [--seed 0] [--json]

It exits 1 when any request got a 5xx or no answer, or the ring changed its answer (each such finding is printed).
"""

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

from prima_rpc.app import ring
from prima_rpc.app.local_ring import launch
from prima_rpc.app.openai_api import ApiConfig
from tools.bench.fuzz_bodies import PATHS, requests
from tools.bench.http_harness import api_in_thread, post
from tools.synth import synth

REFERENCE = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 8, "temperature": 0}).encode()


class Tally:
    """What the fuzzed requests got: counts by dialect and status, and the findings (5xx, no answer)."""

    def __init__(self):
        self.statuses = collections.Counter()
        self.findings: list[str] = []
        self.sent = 0

    def send(self, root: str, dialect: str, body: bytes) -> None:
        self.sent += 1
        try:
            status, text = post(root, PATHS[dialect], body)
        except OSError as exc:  # a dropped connection: no answer at all
            if len(body) > 1 << 20:  # the server may close on a body over its limit before reading it all
                self.statuses[(dialect, "closed")] += 1
                return
            self.findings.append(f"{dialect}: no answer ({type(exc).__name__}: {exc}) to {body[:300]!r}")
            return
        self.statuses[(dialect, status)] += 1
        if status >= 500 or b"Internal error" in text:
            self.findings.append(f"{dialect}: {status} {text[:300]!r} to {body[:300]!r}")

    def errors(self) -> int:
        return len(self.findings)


def fuzz(root: str, n: int, tally: Tally, at_seed: int = 0) -> None:
    """n generated requests to the API at `root`, each recorded in `tally` (no shrinking: a finding is kept whole)."""
    @seed(at_seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def one(request):
        tally.send(root, *request)

    one()


def reference(root: str) -> str:
    status, text = post(root, PATHS["openai-completions"], REFERENCE)
    if status != 200:
        raise RuntimeError(f"the reference request failed: {status} {text[:300]!r}")
    return json.loads(text)["choices"][0]["text"]


def run(n: int, at_seed: int, work: Path) -> dict:
    store = synth(work / "tiny", "tiny", seed=1)
    local = launch(store, 2, log_dir=work / "logs", detach=False)
    try:
        ring.start(local.addresses[0], [4, 4])
        with api_in_thread(ApiConfig(local.addresses[0])) as root:
            before = reference(root)
            tally, started = Tally(), time.monotonic()
            fuzz(root, n, tally, at_seed)
            seconds = time.monotonic() - started
            after = reference(root)
        alive = all(p.poll() is None for p in local.processes)
    finally:
        local.stop()
    by_status = collections.Counter()
    for (_, status), count in tally.statuses.items():
        by_status[str(status)] += count
    return {"requests": tally.sent, "seconds": round(seconds, 1), "by_status": dict(sorted(by_status.items())),
            "server_errors": sum(c for s, c in by_status.items() if s.isdigit() and int(s) >= 500),
            "findings": tally.findings, "nodes_alive": alive, "reference_unchanged": before == after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fuzz-http-") as work:
        result = run(args.requests, args.seed, Path(work))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['requests']} requests in {result['seconds']} s; by status: "
              + ", ".join(f"{s}: {c}" for s, c in result["by_status"].items()))
        print(f"5xx: {result['server_errors']}; findings: {len(result['findings'])}; nodes alive: "
              f"{result['nodes_alive']}; reference unchanged: {result['reference_unchanged']}")
        for finding in result["findings"][:20]:
            print("  " + finding)
    ok = not result["findings"] and result["nodes_alive"] and result["reference_unchanged"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
