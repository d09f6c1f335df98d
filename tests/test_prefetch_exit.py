"""A process that ends with its prefetcher still reading exits cleanly: the reader thread is stopped at exit, before
the interpreter finalizes (a daemon thread inside torch then aborts the process: nodes/engine/prefetch.py)."""

from tests.subprocesses import run_python

SCRIPT = r"""
import atexit, sys, torch
from prima_rpc.spec.windows import Windows
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore

store = LayerStore(sys.argv[1])
n = store.config.n_layers
shard = Shard(store, Windows(((0, n),), n, True), torch.float32, budget=1, depth=1)
cache = shard.cache_for("r", 0, 4, 2)
shard.compute(shard.embed([1, 2]), cache, 0, 0)
thread = shard.prefetcher.thread
assert thread.is_alive()
atexit._run_exitfuncs()  # what the interpreter runs at exit, before it finalizes
print("alive" if thread.is_alive() else "stopped")
"""


def test_a_streaming_shard_stops_its_reader_at_exit(tiny_store):
    assert run_python(SCRIPT, str(tiny_store), timeout=120).split()[-1] == "stopped"
