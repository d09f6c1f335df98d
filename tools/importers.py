"""The one door from the application to the model importers: a GGUF file or a Hugging Face directory into a
per-layer store, the default model, and synthetic stores. Each importer is imported when used (they pull
in gguf, safetensors and numpy only then)."""

from pathlib import Path

from tools.default_model import DEFAULT_DTYPE, default_store_dir, ensure_default_store

__all__ = ["DEFAULT_DTYPE", "default_store_dir", "ensure_default_store", "import_model", "synth_store"]


def import_model(src: Path, out: Path, *, dtype: str | None, overwrite: bool, progress) -> Path:
    """Import `src` (a directory: Hugging Face safetensors; a file: GGUF) into the store `out`."""
    if src.is_dir():
        from tools.import_hf import import_hf

        import_hf(src, out, dtype=dtype, overwrite=overwrite, progress=progress)
    else:
        from tools.import_gguf import import_gguf

        import_gguf(src, out, dtype=dtype or "float32", overwrite=overwrite, progress=progress)
    return out


def synth_store(out: Path, preset: str, **options) -> Path:
    """A store of random weights in a real model's shape (tools/synth.py)."""
    from tools.synth import synth

    return synth(out, preset, **options)
