"""prima-node whose first compute of one layer raises, once: a mock of a fault nothing real causes on demand (an
unexpected exception inside a node's compute). The test that wants it starts this in place of prima-node; the
node's own code holds no hook for it.

    python -m tests.faulty_node LAYER [prima-node options]
"""

import sys

from nodes.engine.shard import Shard
from nodes.ring.main import app


def fail_once_at(layer: int) -> None:
    """The first compute_batch whose windows run `layer` raises RuntimeError; every other computes as before."""
    compute_batch = Shard.compute_batch
    armed = [True]

    def faulty(self: Shard, items, next_layer: int):
        if armed[0] and any(a <= layer < b for a, b in self.windows.run_from(next_layer)):
            armed[0] = False
            raise RuntimeError(f"fault injected at layer {layer}")
        return compute_batch(self, items, next_layer)

    Shard.compute_batch = faulty


if __name__ == "__main__":
    fail_once_at(int(sys.argv.pop(1)))
    app()
