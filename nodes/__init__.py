"""A ring node: its actor, links, layer store, prefetch, model math and profiler."""

import os

# torch's OpenMP threads (GNU libgomp) spin this many times after a parallel region before they sleep; read when
# torch loads, so set here, before any node module imports it. A decoder layer is dozens of short regions back to
# back: threads asleep between them (OMP_WAIT_POLICY=PASSIVE) wake late on each (SmolLM2 fp32, 2 cores: 0.84 ms a
# layer against 0.51), while libgomp's default (300k spins, milliseconds) keeps the cores busy after a window is
# done, from the other nodes on the machine and the node's own reader and event loop. Measured on 3-node loopback
# rings (ms a token, PASSIVE / default / 10k): 10-10-10 33.8 / 41.9 / 24.2, 7-3-5 37.1 / 60.8 / 29.1, 3-1-1 46.3 /
# 124.1 / 36.7; one node holding all 30 layers 30.1 / 18.6 / 18.6.
OMP_SPIN_COUNT = "10000"
os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPIN_COUNT)
