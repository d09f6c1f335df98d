"""Every entry point sets OpenMP's spin before torch loads libgomp (prima_rpc/__init__.py): read later, it has no
effect. A process alone spins long enough to keep its workers across a layer's Python; nodes a local ring starts on
one machine spin briefly, or they hold each other's cores (libgomp's default) or wake late (PASSIVE)."""

import os
from pathlib import Path

import pytest

from tests.subprocesses import run_python

pytestmark = pytest.mark.slow  # each test starts processes that import torch (nodes, entry points)

# Records GOMP_SPINCOUNT at the moment torch is first imported: by the entry point, or later (the CLI loads it lazily).
SPY = """
import builtins, os
seen = []
real_import = builtins.__import__
def spy(name, *args, **kwargs):
    if name.split(".")[0] == "torch" and not seen:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
import {module}
import torch
print(seen[0])
"""


def torch_sees(module: str, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return run_python(SPY.format(module=module), env={**clean, **env}).strip()


@pytest.mark.parametrize("module", ["nodes.ring.main", "prima_rpc.app.cli", "tools.bench.bench_prediction"])
def test_entry_points_set_their_spin_before_torch_loads(module):
    assert torch_sees(module) == "30000"


@pytest.mark.parametrize("n, spin", [(1, "30000"), (2, "3000")])
def test_nodes_of_a_local_ring_spin_briefly_when_they_share_the_machine(tmp_path, n, spin):
    import prima_rpc
    from prima_rpc.app.local_ring import launch

    if prima_rpc.OPENMP_SET_BY_USER:
        pytest.skip("this run's own OMP_WAIT_POLICY or GOMP_SPINCOUNT reaches the nodes")
    ring = launch(None, n, log_dir=tmp_path, detach=False)
    try:
        for proc in ring.processes:
            env = dict(v.split("=", 1) for v in Path(f"/proc/{proc.pid}/environ").read_text().split("\0") if "=" in v)
            assert env["GOMP_SPINCOUNT"] == spin
    finally:
        ring.stop()


def test_a_users_own_openmp_setting_wins():
    assert torch_sees("nodes.ring.main", OMP_WAIT_POLICY="PASSIVE") == "None"
    assert torch_sees("nodes.ring.main", GOMP_SPINCOUNT="50000") == "50000"
