"""Shared fixtures: the real SmolLM2 store (imported once) and tiny synthetic stores."""

from pathlib import Path

import pytest

from prima_rpc.app.local_ring import launch
from tools.default_model import ensure_default_store
from tools.synth import synth


@pytest.fixture(scope="session")
def smol_store() -> Path:
    return ensure_default_store()


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("stores") / "tiny", "tiny", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen_store(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("stores") / "tiny-qwen2", "tiny-qwen2", seed=2)


@pytest.fixture(scope="module")
def rings(smol_store, tmp_path_factory):
    """Local rings by size, started once per module and stopped at the end."""
    started = {}

    def get(n: int):
        if n not in started:
            started[n] = launch(smol_store, n, log_dir=tmp_path_factory.mktemp(f"ring{n}"), detach=False)
        return started[n]

    yield get
    for r in started.values():
        r.stop()
