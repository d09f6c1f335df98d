"""Shared fixtures: the real SmolLM2 store (imported once), tiny synthetic stores, and SmolLM2 rings by size."""

import gc
from pathlib import Path

import pytest

from tests.rings import SECRET, Rings, ring_key
from tools.default_model import ensure_default_store
from tools.synth import synth


def pytest_collection_finish(session):
    # What collecting imported (torch, transformers, the test modules: ~240k objects) is kept for the session: the
    # tests' full collections walk only what they made (160 in-process tests, load 9: 5.1 s in gen2 against 9.9).
    gc.freeze()


@pytest.fixture(scope="session")
def smol_store() -> Path:
    return ensure_default_store()


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("stores") / "tiny", "tiny", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen_store(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("stores") / "tiny-qwen2", "tiny-qwen2", seed=2)


# The ring size most SmolLM2 ring modules read from (eleven of them): one ring for the session instead of one a
# module, each a start, an assignment and a stop of three processes (~20-40 s on 2 cores).
SHARED_SIZE = 3


@pytest.fixture(scope="session")
def shared_rings(smol_store, tmp_path_factory):
    pool = Rings(smol_store, tmp_path_factory.mktemp)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def own_rings(smol_store, tmp_path_factory):
    """rings(n, windows) of the module's own: started in it and stopped at its end (for a module that must be the
    only one a ring has seen)."""
    pool = Rings(smol_store, tmp_path_factory.mktemp)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def rings(shared_rings, own_rings):
    """rings(n, windows): a local SmolLM2 ring of n nodes, assigned `windows` (head first) on every call that gives
    them. The 3-node ring is the session's, restored at the module's first use (ring tests assign it before they
    read from it, which gives every node a fresh shard, KV and prefix caches); other sizes are the module's own."""
    shared = restored_at_first_use(shared_rings)

    def get(n: int, windows: list[int] | None = None):
        return shared(n, windows) if n == SHARED_SIZE else own_rings(n, windows)

    return get


# The tiny store's rings, plain and with a cluster token (tests.rings.SECRET), shared by the modules that only read
# from them and assign them first: fuzzing, the CLI's first hour, context, prefixes, auth, the local ring's CLI.
@pytest.fixture(scope="session")
def shared_tiny_rings(tiny_store, tmp_path_factory):
    pool = Rings(tiny_store, tmp_path_factory.mktemp)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def shared_secured_rings(tiny_store, tmp_path_factory):
    pool = Rings(tiny_store, tmp_path_factory.mktemp, token=SECRET)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def tiny_rings(shared_tiny_rings):
    """rings(n, windows, extra_args): a local ring of the tiny store, the session's, restored at the module's first
    use of each shape."""
    return restored_at_first_use(shared_tiny_rings)


@pytest.fixture(scope="module")
def secured_rings(shared_secured_rings):
    """tiny_rings whose nodes take the cluster token tests.rings.SECRET."""
    return restored_at_first_use(shared_secured_rings)


def restored_at_first_use(pool: Rings):
    """pool's rings, each restored (tests/rings.py Rings.restore) the first time this module asks for it."""
    restored = set()

    def get(n: int, windows: list[int] | None = None, extra_args: list[list[str]] | None = None):
        key = ring_key(n, extra_args)
        if key not in restored:
            pool.restore(n, extra_args)
            restored.add(key)
        return pool(n, windows, extra_args)

    return get
