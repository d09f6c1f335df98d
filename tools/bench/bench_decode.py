"""Single-process decode benchmark: the reference vs transformers' generate on SmolLM2, side by side.

Each (implementation, dtype) runs in its own subprocess so peak RSS is its own. Decode tokens/s is
(N - 1) / (time for N tokens - time for the first token), greedy, EOS ignored so both make N tokens.

    python -m tools.bench.bench_decode [--tokens 128] [--store DIR]
"""

import argparse
import json
import resource
import subprocess
import sys
import time

PROMPT = "Write a short story about a robot who learns to paint."


def run_reference(store: str, dtype: str, n: int) -> dict:
    import torch

    from nodes.generation import GenerateParams, Generation
    from nodes.reference import ReferenceModel

    model = ReferenceModel(store, dtype=getattr(torch, dtype))
    prompt = model.codec.prompt_ids(PROMPT)

    def timed(tokens: int) -> tuple[float, list[int]]:
        gen = Generation(prompt, GenerateParams(max_tokens=tokens), model.codec, (), model.cfg.max_seq_len)
        cache = model.new_cache(gen.capacity)
        start = time.perf_counter()
        while not gen.done:
            ids, pos = gen.pending()
            gen.accept(model.step(ids, pos, cache))
        return time.perf_counter() - start, gen.tokens

    timed(4)  # warm-up
    first, _ = timed(1)
    total, tokens = timed(n)
    return {"decode_tok_s": (n - 1) / (total - first), "ttft_ms": first * 1e3, "tokens": tokens}


def run_transformers(gguf: str, dtype: str, n: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf.rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]

    def timed(tokens: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()

    timed(4)
    first, _ = timed(1)
    total, tokens = timed(n)
    return {"decode_tok_s": (n - 1) / (total - first), "ttft_ms": first * 1e3, "tokens": tokens}


def child(args) -> None:
    fn = run_reference if args.impl == "prima" else run_transformers
    result = fn(args.store if args.impl == "prima" else args.gguf, args.dtype, args.tokens)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    from tools.default_model import default_gguf, ensure_default_store

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--store", default=None)
    p.add_argument("--gguf", default=None)
    p.add_argument("--impl", choices=["prima", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.gguf = args.gguf or str(default_gguf())
    args.store = args.store or str(ensure_default_store())
    if args.impl:
        return child(args)
    rows = {}
    for dtype in ("float32", "bfloat16"):
        for impl in ("transformers", "prima"):
            cmd = [sys.executable, "-m", "tools.bench.bench_decode", "--impl", impl, "--dtype", dtype,
                   "--tokens", str(args.tokens), "--store", args.store, "--gguf", args.gguf]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows[impl, dtype] = json.loads(out.strip().splitlines()[-1])
    print(f"SmolLM2-135M-Instruct, {args.tokens} greedy tokens, prompt {PROMPT!r}")
    print(f"{'dtype':9} {'impl':13} {'decode tok/s':>12} {'TTFT ms':>8} {'peak RSS MiB':>12}")
    for (impl, dtype), r in rows.items():
        print(f"{dtype:9} {impl:13} {r['decode_tok_s']:12.1f} {r['ttft_ms']:8.1f} {r['peak_rss_mib']:12.0f}")
    for dtype in ("float32", "bfloat16"):
        ours, theirs = rows["prima", dtype], rows["transformers", dtype]
        same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
        print(f"{dtype}: prima / transformers decode speed = {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x; "
              f"same greedy tokens: {same}/{args.tokens}")


if __name__ == "__main__":
    main()
