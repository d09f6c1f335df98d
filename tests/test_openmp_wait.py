"""Every entry point sets OpenMP's short spin before torch loads libgomp (prima_rpc/__init__.py): read later, it
has no effect, and co-located nodes either hold each other's cores (libgomp's default) or wake late (PASSIVE)."""

import os

import pytest

from tests.subprocesses import run_python

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
def test_entry_points_set_a_short_spin_before_torch_loads(module):
    assert torch_sees(module) == "3000"


def test_a_users_own_openmp_setting_wins():
    assert torch_sees("nodes.ring.main", OMP_WAIT_POLICY="PASSIVE") == "None"
    assert torch_sees("nodes.ring.main", GOMP_SPINCOUNT="50000") == "50000"
