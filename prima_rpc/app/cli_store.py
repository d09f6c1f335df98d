"""`prima-ctl import` and `synth`: make a per-layer store from a GGUF file, a Hugging Face directory or a preset."""

from pathlib import Path

import typer

from prima_rpc.app.cli_errors import fail
from prima_rpc.app.progress import bar


def import_(src: Path = typer.Argument(None, help="a GGUF file or a Hugging Face model directory"),
            out: Path = typer.Argument(None, help="the store directory to create"),
            default: bool = typer.Option(False, "--default", help="import SmolLM2 into $PRIMA_HOME/models"),
            dtype: str = typer.Option(None, help="weight dtype of the store: float32, bfloat16, float16, int8 or int4 "
                                                 "(default: a GGUF stays quantized, Q4_0/Q4_1/Q4_K blocks as int4 and "
                                                 "other types as int8; --default alone: int4)"),
            name: str = typer.Option(None, help="the model's name in status, the page and /v1/models "
                                                "(default: OUT's directory name)"),
            chat_template: Path = typer.Option(None, "--chat-template", help="a Jinja chat template file for the store "
                                               "(default: the model's own; a GGUF without one: its family's where "
                                               "that is certain, else none: chats become plain completion)"),
            overwrite: bool = typer.Option(False, help="replace an existing store")):
    """Import a GGUF file or a Hugging Face directory into a per-layer store."""
    if default:
        from tools.importers import DEFAULT_DTYPE, default_store_dir, ensure_default_store

        dtype = dtype or DEFAULT_DTYPE
        with bar(f"importing SmolLM2 into {default_store_dir(dtype)}") as progress:
            print(ensure_default_store(progress=progress, dtype=dtype))
        return
    if src is None or out is None:
        fail("give SRC and OUT, or --default")
    template = read_template(chat_template) if chat_template else None
    if not src.exists():
        fail(f"{src} does not exist")
    from tools.importers import import_model

    with bar(f"importing {src.name}") as progress:
        done = import_model(src, out, dtype=dtype, overwrite=overwrite, progress=progress, name=name,
                            chat_template=template)
    print("\n".join([*done.types, done.summary, str(out)]))


def read_template(path: Path) -> str:
    """A chat template file's text, checked to be Jinja that compiles (else a one-line error)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"--chat-template {path}: cannot read it ({exc})")
    if not text.strip():
        fail(f"--chat-template {path}: the file is empty")
    try:
        ImmutableSandboxedEnvironment().from_string(text)
    except TemplateSyntaxError as exc:
        fail(f"--chat-template {path}: not a Jinja template (line {exc.lineno}: {exc.message})")
    return text


def synth(out: Path = typer.Argument(..., help="the store directory to create"),
          preset: str = typer.Option(..., help="llama3-8b, llama3-70b, qwen2.5-32b, qwen2.5-72b, tiny, ..."),
          bits_per_weight: float = typer.Option(None, help="bits per weight on disk (e.g. 4.5 for Q4K sizes)"),
          manifest_only: bool = typer.Option(False, help="write only the manifest (for planning what-ifs)"),
          seed: int = typer.Option(0),
          dtype: str = typer.Option("float32", help="float32, bfloat16, float16, int8 or int4"),
          layers: int = typer.Option(None, help="override the preset's layer count"),
          overwrite: bool = typer.Option(False)):
    """Write a synthetic store with random weights of a real model's shape."""
    from tools.importers import synth_store

    with bar(f"writing {preset}") as progress:
        synth_store(out, preset, seed=seed, dtype=dtype, bits_per_weight=bits_per_weight, manifest_only=manifest_only,
                    overwrite=overwrite, layers=layers, progress=progress)
    print(out)


def default_store() -> Path:
    """SmolLM2 in the default dtype, imported into $PRIMA_HOME/models if missing."""
    from tools.importers import DEFAULT_DTYPE, ensure_default_store

    return ensure_default_store(dtype=DEFAULT_DTYPE)
