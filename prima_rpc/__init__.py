import os

# torch's OpenMP workers wait for the next parallel region by spinning, then sleep. A decoder layer is dozens of
# short regions and Python between them: workers that sleep too soon wake late on each. A process alone on the
# machine's cores spins 30000 times (SmolLM2 F32 decode on 2 cores of the AMX Xeon, 2026-12-05: 31.6-32.6 ms a token,
# 300000 spins 32.1-32.8, 3000 spins 38.4-40.0); nodes that share the cores spin 3000 times (SHARED_SPIN, set by
# prima_rpc.app.local_ring), as libgomp's default 300000 holds the cores the others need (3-node rings on 2 cores:
# PASSIVE 33.4 ms a token, 3000 spins 25.6; the default 41.9 where PASSIVE ran 33.8). Read once, when torch loads
# libgomp: every entry point imports this package (nodes, tools) first. A user's setting wins.
ALONE_SPIN, SHARED_SPIN = "30000", "3000"
OPENMP_SET_BY_USER = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
if not OPENMP_SET_BY_USER:
    os.environ["GOMP_SPINCOUNT"] = ALONE_SPIN
