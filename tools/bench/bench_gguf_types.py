"""GGUF types side by side in one run, on SmolLM2 in each of llama.cpp's types (tools.bench.make_kquants): what each
type becomes in a store, the error of each format it could become, and per file the KL divergence and top-1
agreement of this project's logits against llama.cpp's own on the same file and text, each side's KL against the
base's logits (issue 27's goal: ours <= llama.cpp's own + 10 %), and decode tokens/s of both.

The base is SmolLM2's F32 file; for --8b's 8B-shaped Q4_K_M (tools.bench.make_kquants) the Q8_0 file its weights
were drawn in.

    python -m tools.bench.bench_gguf_types [--work DIR] [--types Q4_K_M Q5_K_M Q6_K Q8_0 IQ4_XS] [--tokens 32] [--8b]
        [--repeats N]
"""

import argparse
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

from tools.bench.markdown import table

THREADS = 2
TEXT = ("The history of the bicycle begins in the early nineteenth century. Inventors in Germany and France built "
        "wooden machines that riders pushed along with their feet. Pedals came later, attached to the front wheel, "
        "and the high-wheeled bicycles of the 1870s made riding fast but dangerous. The safety bicycle, with two "
        "wheels of equal size and a chain driving the rear wheel, changed everything: by 1900 millions of people "
        "rode to work, to school and into the countryside.")


def matrix_errors(files: dict[str, Path]) -> list[list]:
    """Per GGUF type: relative error (Frobenius, of its de-quantized weights) of int8 rows and of int4 groups (its
    blocks kept when INT4_EXACT, else re-quantized), over up to 6 of its matrices across the files."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from nodes.engine.quant import quantize_int4, quantize_int8
    from tools.gguf_types import INT4_EXACT, int4_blocks, store_format

    seen, errs = defaultdict(int), defaultdict(lambda: defaultdict(list))
    for path in files.values():
        for t in GGUFReader(path).tensors:
            kind = t.tensor_type.name
            if len(t.shape) != 2 or seen[kind] >= 6 or kind == "F32":
                continue
            seen[kind] += 1
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), np.float32))
            q, s = quantize_int8(w)
            errs[kind]["int8"].append(((q.float() * s[:, None] - w).norm() / w.norm()).item())
            q, dm = int4_blocks(kind, t.data, *w.shape) if kind in INT4_EXACT else quantize_int4(w)
            g = dm.transpose(0, 1).float().repeat_interleave(32, dim=1)  # [N, K, 2]
            errs[kind]["int4"].append(((q.float() * g[..., 0] + g[..., 1] - w).norm() / w.norm()).item())
    return [[kind, store_format(kind), f"{np.mean(e['int8']) * 100:.2f} %", f"{np.mean(e['int4']) * 100:.2f} %"
             + (" (kept)" if kind in INT4_EXACT else "")] for kind, e in sorted(errs.items())]


def llamacpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(str(path), n_threads=THREADS, n_threads_batch=THREADS, n_ctx=512, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def prima_logits(store: Path, ids: list[int]) -> np.ndarray:
    from nodes.generation.reference import ReferenceModel

    model = ReferenceModel(store)
    return model.step_all(ids, 0, model.new_cache(len(ids))).double().numpy()


def kl_top1(p_logits: np.ndarray, q_logits: np.ndarray) -> tuple[float, float]:
    """Mean KL(P || Q) over positions (P: the reference) and how often their argmax agree."""
    p, q = (torch.from_numpy(x).log_softmax(-1) for x in (p_logits, q_logits))
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return kl, (p.argmax(-1) == q.argmax(-1)).double().mean().item()


def decode(impl: str, path: Path, tokens: int, dtype: str | None = None) -> float:
    """dtype: prima's activations (the store's measured choice, as its logits above and a node use)."""
    cmd = [sys.executable, "-m", "tools.bench.bench_decode", "--impl", impl, "--path", str(path), "--tokens",
           str(tokens)] + (["--dtype", dtype] if dtype else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]


def bits_on_disk(path: Path) -> float:
    from gguf import GGUFReader

    tensors = [t for t in GGUFReader(path).tensors if len(t.shape) == 2]
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def file_row(kind: str, gguf: Path, store: Path, ids: list[int], base: np.ndarray, tokens: int,
             repeats: int = 1) -> list:
    """One file's row: what its store became, bits per weight, KL / top-1 against llama.cpp on the same file,
    each side's KL against the base's logits (llama.cpp F32's), decode tokens/s of both."""
    from nodes.engine.dtype_choice import compute_dtype
    from prima_rpc.spec.manifest import read_manifest
    from tools.import_gguf import import_gguf

    if not (store / "manifest.json").is_file():
        import_gguf(gguf, store)
    m, _ = read_manifest(store)
    theirs, ours = llamacpp_logits(gguf, ids), prima_logits(store, ids)
    kl, top1 = kl_top1(theirs, ours)
    own_kl, our_kl = kl_top1(base, theirs)[0], kl_top1(base, ours)[0]
    dtype = compute_dtype(m.dtype)  # bfloat16 forced here ran at 0.32x on AVX2, where bfloat16 is emulated
    runs = [(decode("prima", store, tokens, dtype), decode("llama.cpp", gguf, tokens)) for _ in range(repeats)]
    ours_s, theirs_s = (max(r[i] for r in runs) for i in (0, 1))  # interleaved, the best of each
    becomes = m.dtype + int8_note(m.quant, m.config.n_layers)
    return [kind, becomes, f"{bits_on_disk(gguf):.2f}", f"{m.bits_per_weight:.2f}", f"{kl:.5f}", f"{top1 * 100:.1f} %",
            f"{own_kl:.5f}", f"{our_kl:.5f} ({'met' if our_kl <= 1.1 * own_kl else 'not met'})",
            f"{ours_s:.1f} ({dtype})", f"{theirs_s:.1f}", f"{ours_s / theirs_s:.2f}x"]


def int8_note(quant: dict, n_layers: int) -> str:
    """An int4 store's int8 matrices: " (wqkv, w_down int8 in 2 of 4 layers)" (every layer: " (wqkv int8)")."""
    layers = quant.get("int8_layers") or [quant.get("int8_matrices", [])] * n_layers
    counts = Counter(m for layer in layers for m in layer)
    groups = defaultdict(list)  # how many layers -> the matrices int8 in that many
    for m, c in counts.items():
        groups[c].append(m)
    return "".join(f" ({', '.join(ms)} int8{'' if c == n_layers else f' in {c} of {n_layers} layers'})"
                   for c, ms in sorted(groups.items(), reverse=True))


def main() -> None:
    from llama_cpp import Llama

    from prima_rpc.spec.home import prima_home
    from tools.bench.make_kquants import make_8b, make_all

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="decode runs of each side, interleaved; the best kept")
    p.add_argument("--8b", dest="eight_b", action="store_true",
                   help="also the 8B-shaped Q4_K_M (its base: the Q8_0 file its weights were drawn in)")
    args = p.parse_args()
    torch.set_num_threads(THREADS)
    work = args.work or prima_home() / "bench" / "gguf-types"
    files = make_all(work, args.types)
    ids = Llama(str(files["F32"]), vocab_only=True, verbose=False).tokenize(TEXT.encode(), add_bos=True)
    print(f"{len(ids)} tokens of text, {THREADS} threads; decode: {args.tokens} greedy tokens (bench_decode)")
    print(table(["GGUF type", "becomes", "int8 rows error", "int4 groups error"], matrix_errors(files)))
    base = llamacpp_logits(files["F32"], ids)
    rows = []
    for kind in args.types:
        rows.append(file_row(kind, files[kind], work / f"store-{kind}", ids, base, args.tokens, args.repeats))
        print(rows[-1], flush=True)
    if args.eight_b:
        big = make_8b(work)
        rows.append(file_row("8B-shaped Q4_K_M", big["Q4_K_M"], work / "store-8b-Q4_K_M", ids,
                             llamacpp_logits(big["Q8_0"], ids), args.tokens, args.repeats))
        print(rows[-1], flush=True)
    print(table(["file", "store", "bits/weight (file)", "bits/weight (store)", "KL vs llama.cpp", "top-1 agree",
                 "llama.cpp KL vs base", "prima KL vs base (goal <= llama.cpp's + 10 %)", "prima tok/s",
                 "llama.cpp tok/s", "ratio"], rows, right=range(2, 11)))


if __name__ == "__main__":
    main()
