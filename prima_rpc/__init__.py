import os

# torch's OpenMP workers wait for the next parallel region by spinning, then sleep. A decoder layer is dozens of
# short regions: sleeping workers (OMP_WAIT_POLICY=PASSIVE) wake late on each (SmolLM2 fp32, 0.84 ms a layer
# against 0.51 spinning); libgomp's default 300k spins hold the cores that co-located nodes need (3-node rings on
# 2 cores: PASSIVE 33.4 ms a token, 3000 spins 25.6; the default 41.9 where PASSIVE ran 33.8). Read once, when
# torch loads libgomp: every entry point imports this package (nodes, tools) first. A user's setting wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")
