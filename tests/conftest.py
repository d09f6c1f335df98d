"""Shared fixtures: the real SmolLM2 store (imported once) and tiny synthetic stores."""

from pathlib import Path

import pytest

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
