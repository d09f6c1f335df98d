"""Predicted vs measured TPOT on real loopback rings: the cost model checked against the ring itself.

    python -m tools.bench.bench_prediction [--tokens 32] [--repeats 2]

Starts 3 prima-node processes with SmolLM2, profiles them live (Control.Profile, one at a time), then
for each ring shape applies the windows, predicts TPOT with the solver's cost model for exactly those
windows, and measures TPOT (head-side, median of repeats) in the same run.
"""

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from prima_rpc import ring
from prima_rpc.client import Finished, PrimaClient
from prima_rpc.live_plan import profile_ring
from prima_rpc.local_ring import launch
from solver.cost_model import Instance
from solver.model_profile import ModelProfile
from solver.plan import build_plan
from solver.profiles import devices_from_json
from tools.default_model import ensure_default_store

PROMPT = "Write a short story about a robot who learns to paint."
SHAPES = [[10, 10, 10], [20, 5, 5], [7, 3, 5], [3, 1, 1], [15, 15, 0]]


async def tpot(head: str, tokens: int) -> float:
    async with PrimaClient(head) as client:
        async for event in client.generate(PROMPT, max_tokens=tokens):
            if isinstance(event, Finished):
                return event.tpot_ms


def predicted_ms(devices, manifest: dict, windows: list[int]) -> float:
    model = ModelProfile.from_manifest(manifest)
    inst = Instance(devices, model)
    k = model.n_layers // sum(windows)
    in_ring = [True] * len(windows)  # relays stay in the ring: they still cost a hop
    return build_plan(inst, k, windows, [0] * len(windows), in_ring, 0.0, "fixed").predicted_tpot_s * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    store = ensure_default_store()
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        local = launch(store, 3, log_dir=Path(logs), detach=False)
        try:
            ring.start(local.addresses[0], [10, 10, 10])
            profiles, manifest = profile_ring(local.addresses[0], None, refresh=True)
            devices = devices_from_json(profiles)
            for windows in SHAPES:
                ring.start(local.addresses[0], windows)
                asyncio.run(tpot(local.addresses[0], 4))  # warm-up
                measured = statistics.median(asyncio.run(tpot(local.addresses[0], args.tokens))
                                             for _ in range(args.repeats))
                rows.append((windows, predicted_ms(devices, manifest, windows), measured))
        finally:
            local.stop()
    print(f"SmolLM2-135M fp32, 3 nodes on loopback, {args.tokens} tokens, median of {args.repeats}")
    print(f"{'windows':14} {'k':>2} {'predicted ms':>12} {'measured ms':>11} {'error':>7}")
    for windows, pred, meas in rows:
        print(f"{str(windows):14} {30 // sum(windows):2d} {pred:12.1f} {meas:11.1f} {(pred - meas) / meas:+7.0%}")


if __name__ == "__main__":
    main()
