"""prima-node on a device whose owner needs memory back while a trigger file exists: its available memory then
reads 1 MiB (as a testbed's cgroup limit would say it). A mock of what cannot be caused on a shared machine (filling
its memory); the node's own code holds no hook for it.

    python -m tests.owner_needs_memory TRIGGER_FILE [prima-node options]
"""

import sys
from pathlib import Path

from nodes.ring import owner
from nodes.ring.main import app


def short_while(trigger: Path) -> None:
    available = owner.available_memory
    owner.available_memory = lambda: (1 << 20) if trigger.exists() else available()


if __name__ == "__main__":
    short_while(Path(sys.argv.pop(1)))
    app()
