"""`prima-ctl`: import and synthesise models, run the reference, and drive a ring of nodes."""

import json
import sys
import time
from pathlib import Path

import typer

from prima_rpc.app import cli_args, cli_lifecycle, cli_plan, cli_ring, cli_serve
from prima_rpc.app.cli_errors import Typer, fail, guarded
from prima_rpc.app.progress import bar

app = Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
            help="Control prima-rpc: import models, plan and start rings, generate text.")
state: dict = {"node": "127.0.0.1:7000", "token": None, "node_given": False}


@app.callback()
def main(node: str = typer.Option(None, "--node", show_default=False,
                                  help="HOST:PORT of any node of the ring (default: 127.0.0.1:7000)"),
         token_file: Path = typer.Option(None, "--token-file", metavar="PATH", show_default=False,
                                         help="a file holding the cluster secret (default: $PRIMA_TOKEN); "
                                              "never on the command line, where ps shows it")):
    try:
        state["token"] = cli_args.read_token(token_file)
    except ValueError as exc:
        fail(str(exc))
    state["node"] = cli_args.address(node or state["node"], "--node")
    state["node_given"] = node is not None


@app.command("import")
@guarded
def import_(src: Path = typer.Argument(None, help="a GGUF file or a Hugging Face model directory"),
            out: Path = typer.Argument(None, help="the store directory to create"),
            default: bool = typer.Option(False, "--default", help="import SmolLM2 into $PRIMA_HOME/models"),
            dtype: str = typer.Option(None, help="weight dtype of the store: float32, bfloat16, float16, int8 or int4 "
                                                 "(GGUF Q4_0/Q4_1 blocks become int4 exactly; --default alone: int4)"),
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
    if not src.exists():
        fail(f"{src} does not exist")
    from tools.importers import import_model

    with bar(f"importing {src.name}") as progress:
        import_model(src, out, dtype=dtype, overwrite=overwrite, progress=progress)
    print(out)


@app.command()
@guarded
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


@app.command()
@guarded
def run(prompt: str = typer.Argument(..., help="one user message (or raw text with --raw)"),
        model: Path = typer.Option(None, help="store directory (default: SmolLM2 in int4, imported if missing)"),
        max_tokens: int = typer.Option(128), temperature: float = typer.Option(0.0),
        top_k: int = typer.Option(0), top_p: float = typer.Option(1.0), seed: int = typer.Option(None),
        stop: list[str] = typer.Option([], help="stop string (repeatable)"),
        raw: bool = typer.Option(False, help="no chat template"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
        dtype: str = typer.Option(None, help="compute dtype: float32 or bfloat16 (default: float32 for float "
                                              "stores; for int8/int4 the fastest this machine measures)"),
        speculate: str = typer.Option("off", help="off | ngram (prompt lookup) | draft (needs --draft)"),
        draft: Path = typer.Option(None, help="draft model store (same tokenizer) for --speculate draft"),
        draft_tokens: int = typer.Option(4, help="most tokens drafted per forward (1-16)")):
    """Generate with the single-process reference (the oracle every ring is checked against)."""
    cli_args.generate_args(prompt, max_tokens, temperature, top_k, top_p, seed, stop)
    from nodes.errors import Rejected
    from nodes.generation.draft import DraftModel, load_draft
    from nodes.generation.speculate import SpeculateParams, Speculator

    try:
        speculation = SpeculateParams(speculate, draft_tokens)
        if speculate == "draft" and draft is None:
            raise ValueError("--speculate draft needs --draft DIR (a store of the same tokenizer)")
    except ValueError as exc:
        fail(str(exc))
    if draft is not None:
        cli_args.store(draft)
    if model is not None:
        cli_args.store(model)
    import torch

    from nodes.generation.reference import ReferenceModel
    from nodes.generation.sampling import SamplingParams
    from nodes.generation.state import GenerateParams

    if dtype not in (None, "float32", "bfloat16"):
        fail(f"--dtype must be float32 or bfloat16, got {dtype}")
    params = GenerateParams(max_tokens=max_tokens, stop=tuple(stop),
                            sampling=SamplingParams(temperature, top_k, top_p, seed), speculate=speculation)
    torch_dtype = getattr(torch, dtype) if dtype else None
    ref = ReferenceModel(model or _default_model(), dtype=torch_dtype)
    prompt_ids = ref.codec.prompt_ids(prompt, raw=raw)
    drafter = None
    if speculate == "draft":
        try:
            drafter = DraftModel(load_draft(draft, ref.codec, torch_dtype))
        except Rejected as exc:
            fail(str(exc))
    tokens, text, stamps, spec = [], [], [], Speculator(speculation, drafter)
    start = time.perf_counter()
    for out in ref.generate_ids(prompt_ids, params, spec):
        stamps.append(time.perf_counter())
        tokens.append(out.token_id)
        text.append(out.text)
        if not json_out:
            sys.stdout.write(out.text)
            sys.stdout.flush()
    if json_out:
        ttft = (stamps[0] - start) * 1e3 if stamps else 0.0
        tpot = (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1) if len(stamps) > 1 else 0.0
        print(json.dumps({"tokens": tokens, "text": "".join(text), "prompt_tokens": len(prompt_ids),
                          "ttft_ms": ttft, "tpot_ms": tpot, "drafted": spec.drafted, "accepted": spec.accepted}))
    else:
        print()


cli_ring.register(app, state)
cli_lifecycle.register(app, state)
cli_plan.register(app, state)
cli_serve.register(app, state)


def _default_model() -> Path:
    from tools.importers import DEFAULT_DTYPE, ensure_default_store

    return ensure_default_store(dtype=DEFAULT_DTYPE)


if __name__ == "__main__":  # python -m prima_rpc.app.cli
    app()
