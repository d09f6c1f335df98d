"""Shared fixtures: the real SmolLM2 store (imported once), tiny synthetic stores, and SmolLM2 rings by size."""

from contextlib import ExitStack
from pathlib import Path

import pytest

from prima_rpc.app import ring
from tests.rings import local_ring
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
    """rings(n, windows): the module's local ring of n nodes, started once and stopped at the end; assigned
    `windows` (head first) on every call that gives them."""
    with ExitStack() as stack:
        started = {}

        def get(n: int, windows: list[int] | None = None):
            if n not in started:
                started[n] = stack.enter_context(local_ring(smol_store, n, tmp_path_factory.mktemp(f"ring{n}")))
            if windows is not None:
                ring.start(started[n].addresses[0], windows)
            return started[n]

        yield get
