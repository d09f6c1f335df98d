"""Where one process's decode step goes, op by op: torch.profiler over greedy decode steps of the reference model
(the maths every ring node runs), ops ranked by self CPU time per token, plus the step's wall time.

    python -m tools.bench.profile_step [--store DIR | --dtype int4] [--compute float32] [--threads 1] [--tokens 32]
        [--rows 25]

--compute is the activation dtype (default: the machine's measured choice, nodes/engine/dtype_choice.py). q4.c's
and ops.c's calls (ctypes, not aten ops) are wrapped here in record_function, so they show as "q4.c ..." and
"ops.c ..." rows.
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nodes.engine.kernels import ops, q4
from nodes.generation.reference import ReferenceModel
from tools.default_model import ensure_default_store

PROMPT = "Write a short story about a robot who learns to paint."


def traced(name: str, fn):
    def call(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", help="a store directory (default: SmolLM2 of --dtype)")
    p.add_argument("--dtype", default="int4", help="the default model's store dtype: int4, int8, float32")
    p.add_argument("--compute", help="activation dtype (default: the machine's measured choice)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=25, help="ops shown")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    q4.Q4Rows.mm = traced("q4.c int4 mm", q4.Q4Rows.mm)  # this process only: its own op rows
    q4.int8_mm = traced("q4.c int8 mm", q4.int8_mm)
    ops.rms_norm = traced("ops.c rms_norm", ops.rms_norm)
    ops.attend_rows = traced("ops.c attend_rows", ops.attend_rows)
    store = args.store or str(ensure_default_store(dtype=None if args.dtype == "float32" else args.dtype))
    model = ReferenceModel(store, dtype=getattr(torch, args.compute) if args.compute else None)
    ids = model.codec.prompt_ids(PROMPT, raw=True)
    cache = model.new_cache(len(ids) + 2 * args.tokens + 8)
    with torch.inference_mode():
        logits = model.step(ids, 0, cache)
        pos, tok = len(ids), int(logits[-1].argmax())
        for _ in range(4):  # warm-up
            tok, pos = int(model.step([tok], pos, cache)[-1].argmax()), pos + 1
        began = time.perf_counter()
        for _ in range(args.tokens):
            tok, pos = int(model.step([tok], pos, cache)[-1].argmax()), pos + 1
        wall = (time.perf_counter() - began) / args.tokens
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.tokens):
                tok, pos = int(model.step([tok], pos, cache)[-1].argmax()), pos + 1
    events = prof.key_averages()
    aten = sum(e.self_cpu_time_total for e in events) / args.tokens / 1e3
    print(f"store {store}, compute {model.dtype}, {args.threads} thread(s), ISA "
          f"{torch.backends.cpu.get_cpu_capability()}: {wall * 1e3:.2f} ms a token unprofiled "
          f"({1 / wall:.1f} tok/s); profiled ops' self time {aten:.2f} ms a token")
    print(f"{'op':40} {'calls/token':>11} {'ms/token':>9} {'share':>6}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.rows]:
        ms = e.self_cpu_time_total / args.tokens / 1e3
        print(f"{e.key[:40]:40} {e.count / args.tokens:11.1f} {ms:9.3f} {ms / aten:6.1%}")


if __name__ == "__main__":
    main()
