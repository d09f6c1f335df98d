"""The one door from the application to the model importers: a GGUF file or a Hugging Face directory into a
per-layer store, the default model, and synthetic stores. Each importer is imported when used (they pull
in gguf, safetensors and numpy only then)."""

import time
from dataclasses import dataclass
from pathlib import Path

from tools.default_model import DEFAULT_DTYPE, default_store_dir, ensure_default_store

__all__ = ["DEFAULT_DTYPE", "Imported", "default_store_dir", "ensure_default_store", "import_model", "synth_store"]


@dataclass(frozen=True)
class Imported:
    store: Path
    types: list[str]  # GGUF: one line per tensor type, what it became
    summary: str  # one line: the store, its dtype and size, the time taken


def import_model(src: Path, out: Path, *, dtype: str | None, overwrite: bool, progress,
                 name: str | None = None, chat_template: str | None = None) -> Imported:
    """Import `src` (a directory: Hugging Face safetensors; a file: GGUF, kept quantized unless `dtype` says) into
    the store `out`, named `name` (None: out's directory name), with `chat_template` (None: the model's own)."""
    start, types = time.perf_counter(), []
    if src.is_dir():
        from tools.import_hf import import_hf

        import_hf(src, out, dtype=dtype, name=name, overwrite=overwrite, progress=progress, chat_template=chat_template)
    else:
        from tools.import_gguf import import_gguf

        import_gguf(src, out, dtype=dtype, name=name, overwrite=overwrite, progress=progress, log=types.append,
                    chat_template=chat_template)
    return Imported(out, types, summary_line(out, time.perf_counter() - start))


def summary_line(store: Path, seconds: float) -> str:
    from prima_rpc.spec.manifest import read_manifest

    m, _ = read_manifest(store)
    size = sum(f.stat().st_size for f in store.iterdir() if f.is_file())
    return f"made {m.name!r}: {m.dtype}, {size / 1e6:.1f} MB ({m.bits_per_weight:.2f} bits/weight), in {seconds:.1f} s"


def synth_store(out: Path, preset: str, **options) -> Path:
    """A store of random weights in a real model's shape (tools/synth.py)."""
    from tools.synth import synth

    return synth(out, preset, **options)
