"""A ring node: its actor, links, layer store, prefetch, model math and profiler."""

import os

# torch's OpenMP threads (GNU libgomp) spin this many times after a parallel region before they sleep; read when
# torch loads, so set here, before any node module imports it. A decoder layer is dozens of short regions back to
# back: threads asleep between them (OMP_WAIT_POLICY=PASSIVE) wake late on each (SmolLM2 fp32, 2 cores: 0.84 ms a
# layer against 0.51 at 10k spins), while libgomp's default (300k, milliseconds) keeps the cores busy after a
# window is done, from the other nodes on the machine and the node's own reader. 3-node loopback rings, ms a token,
# PASSIVE / default / 10k: 10-10-10 33.8 / 41.9 / 24.2, 7-3-5 37.1 / 60.8 / 29.1, 3-1-1 46.3 / 124.1 / 36.7. Beside
# streaming readers (budgets of 95 % of the layers, 1000 MB/s) 10k spins lost: 10-10-10 and 5-5-5, resident then
# streaming, PASSIVE 34.2 37.8 63.9 52.3; 10k 22.7 26.3 73.3 64.3; 3k 24.5 26.6 68.0 52.0; 1k 25.1 31.2 64.6 51.7.
# More OpenMP threads than cores make libgomp spin only 100 times (see profiler.profile_device).
OMP_SPIN_COUNT = "3000"
os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPIN_COUNT)
