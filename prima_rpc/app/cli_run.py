"""`prima-ctl run`: generate with the single-process reference, the oracle every ring is checked against."""

import json
import sys
import time
from pathlib import Path

import typer

from prima_rpc.app import cli_args
from prima_rpc.app.cli_errors import cut, fail
from prima_rpc.app.cli_store import default_store
from prima_rpc.request import GenerateRequest

KV_CHOICES = ("auto", "float", "int8", "int4")  # nodes.engine.kv_dtype.CHOICES, without importing torch here


def run(prompt: str = typer.Argument(..., help="one user message (or raw text with --raw)"),
        model: Path = typer.Option(None, help="store directory (default: SmolLM2 in int4, imported if missing)"),
        max_tokens: int = typer.Option(128), temperature: float = typer.Option(None, help=cli_args.TEMPERATURE_HELP),
        top_k: int = typer.Option(0), top_p: float = typer.Option(1.0), seed: int = typer.Option(None),
        stop: list[str] = typer.Option([], help="stop string (repeatable)"),
        raw: bool = typer.Option(False, help="no chat template"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
        dtype: str = typer.Option(None, help="compute dtype: float32 or bfloat16 (default: float32 for float "
                                              "stores; for int8/int4 the fastest this machine measures)"),
        kv_dtype: str = typer.Option("auto", help="how the KV cache stores rows: auto | float | int8 | int4 "
                                                  "(auto: float; quantized as llama.cpp's q8_0 / q4_0)"),
        speculate: str = typer.Option("off", help="off | ngram (prompt lookup) | draft (needs --draft)"),
        draft: Path = typer.Option(None, help="draft model store (same tokenizer) for --speculate draft"),
        draft_tokens: int = typer.Option(4, help="most tokens drafted per forward (1-16)"),
        template_var: list[str] = typer.Option([], help=cli_args.TEMPLATE_VAR_HELP)):
    """Generate with the single-process reference (the oracle every ring is checked against)."""
    request = cli_args.request(prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, stop=stop, raw=raw, speculate=speculate,
                               draft_tokens=draft_tokens, chat_template_kwargs=cli_args.template_vars(template_var))
    params = _reference_params(request)
    if speculate == "draft" and draft is None:
        fail("--speculate draft needs --draft DIR (a store of the same tokenizer)")
    for store in (draft, model):
        if store is not None:
            cli_args.store(store)
    if dtype not in (None, "float32", "bfloat16"):
        fail(f"--dtype must be float32 or bfloat16, got {dtype}")
    if kv_dtype not in KV_CHOICES:
        fail(f"--kv-dtype must be one of {', '.join(KV_CHOICES)}, got {kv_dtype}")
    _generate(request, params, model or default_store(), dtype, draft, json_out, kv_dtype)


def _reference_params(request: GenerateRequest):
    """The reference's GenerateParams (it decodes plainly unless asked: no empty defaults of the head's)."""
    from nodes.generation.speculate import SpeculateParams
    from nodes.generation.state import generate_params

    try:
        return generate_params(request, SpeculateParams(request.speculate, request.draft_tokens))
    except ValueError as exc:
        fail(str(exc))


def _generate(request: GenerateRequest, params, model: Path, dtype: str | None, draft: Path | None,
              json_out: bool, kv_dtype: str = "auto") -> None:
    """Stream the reference's tokens to stdout, or print them as one JSON object."""
    import torch

    from nodes.engine.kv_dtype import kv_dtype as kv_dtype_named
    from nodes.errors import Rejected
    from nodes.generation.draft import DraftModel, load_draft
    from nodes.generation.reference import ReferenceModel
    from nodes.generation.speculate import Speculator
    from nodes.generation.text import PromptError

    torch_dtype = getattr(torch, dtype) if dtype else None
    ref = ReferenceModel(model, dtype=torch_dtype, kv_dtype=kv_dtype_named("float" if kv_dtype == "auto" else kv_dtype))
    try:
        prompt_ids = ref.codec.request_ids(request)
    except PromptError as exc:
        fail(str(exc))
    drafter = None
    if request.speculate == "draft":
        try:
            drafter = DraftModel(load_draft(draft, ref.codec, torch_dtype))
        except Rejected as exc:
            fail(str(exc))
    tokens, text, stamps, spec = [], [], [], Speculator(params.speculate, drafter)
    start = time.perf_counter()
    for out in ref.generate_ids(prompt_ids, params, spec):
        stamps.append(time.perf_counter())
        tokens.append(out.token_id)
        text.append(out.text)
        if not json_out:
            sys.stdout.write(out.text)
            sys.stdout.flush()
    if not json_out:
        cut(ref.finish_reason, request.max_tokens)
        print()
        return
    ttft = (stamps[0] - start) * 1e3 if stamps else 0.0
    tpot = (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    print(json.dumps({"tokens": tokens, "text": "".join(text), "prompt_tokens": len(prompt_ids),
                      "ttft_ms": ttft, "tpot_ms": tpot, "drafted": spec.drafted, "accepted": spec.accepted,
                      "finish_reason": ref.finish_reason}))
