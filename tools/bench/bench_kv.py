"""Quantized KV accuracy: KV bytes a token and greedy agreement of int8 / int4 KV with float KV, and the KL per
position of their next-token distributions against the float cache's (issue 50).

    python -m tools.bench.bench_kv [--tokens 32] [--models smollm2,llama3-8b] [--synth-layers 2] [--json]
    python -m tools.bench.bench_kv --text FILE [--window 512] [--json]

smollm2: the default store (SmolLM2-135M, float32 weights and activations); llama3-8b: a synthetic store of the
Llama 3 8B shape (32 heads, 8 KV heads of 128) with --synth-layers layers and random int4 weights (its tokens mean
nothing; its KV rows have the 8B's width, which is what the KV dtype sees). Every prompt of CHAT (chat template)
and RAW (plain text) is decoded greedily for --tokens tokens with each KV dtype; a prompt agrees when every token
equals float KV's. KL: the float cache's greedy sequence (prompt + its tokens) is forced through every cache, and
KL(p_float || p_kv) of each generated position's next-token distribution is averaged (mean) and its worst (max).
--text FILE: KL of int8 / int4 KV against float KV over a text as llama.cpp's llama-perplexity scores it (the
file's tokens in windows of --window, each window's second half scored), on the default store (SmolLM2's GGUF
dequantized): its figure sits beside llama.cpp's own KL of q8_0 KV on the same GGUF and text,

    llama-perplexity -m SmolLM2-135M-Instruct.Q4_1.gguf -f FILE -c 512 --kl-divergence-base f16.kld
    llama-perplexity -m SmolLM2-135M-Instruct.Q4_1.gguf -f FILE -c 512 --kl-divergence-base f16.kld \
        --kl-divergence -ctk q8_0 -ctv q8_0 -fa on

(the GGUF: tools.default_model.default_gguf(); llama.cpp quantizes V only with flash attention).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from nodes.engine.kv_dtype import FLOAT, INT4, INT8
from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from tools.bench.markdown import table

CHAT = ["What is the capital of France?", "Write a haiku about autumn.", "List three prime numbers.",
        "How do I boil an egg?", "Give me a name for a grey cat.", "Explain what a CPU does in one sentence.",
        "What should I pack for a weekend hike?", "Translate 'good morning' into Spanish."]
RAW = ["The history of the printing press begins", "def fibonacci(n):\n", "Once upon a time, in a small village,",
       "The three laws of thermodynamics are", "Photosynthesis is the process by which",
       "In 1969, the first humans", "A recipe for pancakes: mix flour,"]
KV_DTYPES = (FLOAT, INT8, INT4)


def prompts(model: ReferenceModel) -> list[list[int]]:
    return ([model.codec.prompt_ids(p) for p in CHAT] + [model.codec.prompt_ids(p, raw=True) for p in RAW])


def greedy(model: ReferenceModel, ids: list[int], tokens: int) -> list[int]:
    return [t.token_id for t in model.generate_ids(ids, GenerateParams(max_tokens=tokens))]


def log_probs(model: ReferenceModel, ids: list[int], generated: int) -> torch.Tensor:
    """Log-softmax of the next-token logits at the last `generated` positions of ids [generated, V], prefilled once."""
    cache = model.new_cache(len(ids))
    return model.step_all(ids, 0, cache)[-generated - 1:-1].log_softmax(-1)


def measure(store: Path, tokens: int, dtype: torch.dtype | None = None) -> dict:
    """Per KV dtype: bytes a token over the whole model, prompts agreeing with float KV, KL mean / max."""
    models = {kv.name: ReferenceModel(store, dtype, kv) for kv in KV_DTYPES}
    base = models["float"]
    cfg = base.cfg
    all_ids = prompts(base)
    runs = {name: [greedy(m, ids, tokens) for ids in all_ids] for name, m in models.items()}
    kls: dict[str, list[float]] = {kv.name: [] for kv in KV_DTYPES}
    for ids, out in zip(all_ids, runs["float"], strict=True):
        forced = ids + out
        ref = log_probs(base, forced, len(out))
        for name, m in models.items():
            lp = log_probs(m, forced, len(out))
            kls[name] += (ref.exp() * (ref - lp)).sum(-1).clamp_min(0).tolist()
    rows = {}
    for kv in KV_DTYPES:
        agree = sum(a == b for a, b in zip(runs[kv.name], runs["float"], strict=True))
        rows[kv.name] = {"bytes_per_token": kv.bytes_per_token(cfg.n_kv_heads, cfg.head_dim, base.dtype, cfg.n_layers),
                         "agree": agree, "prompts": len(all_ids),
                         "kl_mean": statistics.fmean(kls[kv.name]), "kl_max": max(kls[kv.name])}
    float16 = FLOAT.bytes_per_token(cfg.n_kv_heads, cfg.head_dim, torch.float16, cfg.n_layers)
    for row in rows.values():
        row["vs_float16"] = row["bytes_per_token"] / float16
    return {"model": base.store.manifest.name, "compute_dtype": str(base.dtype).removeprefix("torch."),
            "tokens": tokens, "kv": rows}


def text_kl(store: Path, text: str, window: int) -> dict:
    """KL(p_float || p_kv) per scored position of `text` (windows of `window` tokens, the second half of each
    scored, as llama-perplexity does): mean and max per quantized KV dtype, and the positions scored."""
    models = {kv.name: ReferenceModel(store, None, kv) for kv in KV_DTYPES}
    ids = models["float"].codec.encode(text)
    kls: dict[str, list[float]] = {"int8": [], "int4": []}
    for lo in range(0, len(ids) - window + 1, window):
        chunk = ids[lo:lo + window]
        lps = {name: m.step_all(chunk, 0, m.new_cache(window))[window // 2:].log_softmax(-1)
               for name, m in models.items()}
        for name in kls:
            kls[name] += (lps["float"].exp() * (lps["float"] - lps[name])).sum(-1).clamp_min(0).tolist()
    if not kls["int8"]:
        raise SystemExit(f"error: the text has {len(ids)} tokens, fewer than one window of {window}")
    return {"model": models["float"].store.manifest.name, "positions": len(kls["int8"]), "window": window,
            "kl": {name: {"mean": statistics.fmean(v), "max": max(v)} for name, v in kls.items()}}


def synthetic_8b(layers: int, root: Path) -> Path:
    from tools.synth import synth

    return synth(root / "llama3-8b", "llama3-8b", seed=3, dtype="int4", layers=layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--models", default="smollm2,llama3-8b")
    parser.add_argument("--synth-layers", type=int, default=2)
    parser.add_argument("--text", type=Path, help="KL over this text file instead, as llama-perplexity scores it")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.text is not None:
        from tools.default_model import ensure_default_store

        result = text_kl(ensure_default_store(), args.text.read_text(), args.window)
        print(json.dumps(result) if args.json else
              f"{result['model']}, {result['positions']} positions scored: KL vs float KV " + ", ".join(
                  f"{n} mean {k['mean']:.2e} max {k['max']:.2e}" for n, k in result["kl"].items()))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "smollm2":
                from tools.default_model import ensure_default_store

                results.append(measure(ensure_default_store(), args.tokens))
            elif name == "llama3-8b":
                results.append(measure(synthetic_8b(args.synth_layers, Path(tmp)), args.tokens))
            else:
                parser.error(f"unknown model {name!r}: smollm2 or llama3-8b")
    if args.json:
        print(json.dumps(results))
        return
    rows = [(r["model"], name, r["compute_dtype"], k["bytes_per_token"], f"{k['vs_float16']:.2f}x",
             f"{k['agree']}/{k['prompts']}", f"{k['kl_mean']:.2e}", f"{k['kl_max']:.2e}")
            for r in results for name, k in r["kv"].items()]
    print(table(["model", "KV", "compute", "KV bytes/token", "vs float16", "greedy agree", "KL mean", "KL max"],
                rows, right=(3, 4, 5, 6, 7)))
    print(f"({args.tokens} tokens a prompt)")


if __name__ == "__main__":
    main()
