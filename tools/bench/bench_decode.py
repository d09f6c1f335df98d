"""Single-process decode benchmark, side by side in one run: the reference on float32, bfloat16, int8 and int4
stores vs llama.cpp on the same GGUF (and transformers on SmolLM2's, with --transformers).

Models: `smollm2` (the default model's Q4_1 GGUF, int4 keeps its blocks exactly; and its F32 de-quantization with
llama.cpp's Q8_0, Q4_0 and Q4_K_M of that, each imported with its types kept, tools.bench.make_kquants) and `8b`
(llama3-8b layer dims, 4 layers, seeded random Q4_0 / Q8_0 blocks written by tools.bench.make_gguf, SmolLM2's
tokenizer; int4 from the Q4_0 file, int8 and bfloat16 from the Q8_0 one; Q4_K_M: llama.cpp's quantizer on the Q8_0 file,
imported with its types kept, tools.bench.make_kquants). Stores and files are made on first use under
--work. llama.cpp is llama-cpp-python: used when importable, installed with pip on demand with
`--llama-cpp install`, skipped with `off` (it is not a dependency of the project).

Each row runs in its own subprocess (peak RSS is its own). Decode tokens/s is (N - 1) / (time for N tokens -
time for the first), greedy, EOS ignored, the same raw prompt, 2 threads (--threads). `--prompt-tokens P` makes
the prompt P tokens long (the prompt's tokens repeated) and adds prefill tokens/s, P / TTFT: with P = 512, the
figure llama.cpp's `llama-bench` calls pp512. `--clock cpu` times the
process's CPU time instead of the wall clock: with --threads 1, on a machine shared with other work, a row's time
then leaves out the spells it waited for a core (both implementations alike).

    python -m tools.bench.bench_decode [--models smollm2 8b] [--tokens 32] [--llama-cpp auto|install|off]
        [--threads 2] [--clock wall|cpu] [--prompt-tokens 512]
"""

import argparse
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a short story about a robot who learns to paint."
THREADS = 2
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def stretched(ids: list[int], length: int | None) -> list[int]:
    """The prompt's tokens repeated to `length` (None: as it is)."""
    return ids if not length else (ids * -(-length // len(ids)))[:length]


def run_prima(store: str, dtype: str, n: int, threads: int, clock, length: int | None = None) -> dict:
    import torch

    from nodes.generation.reference import ReferenceModel
    from nodes.generation.state import GenerateParams, Generation

    torch.set_num_threads(threads)
    model = ReferenceModel(store, dtype=getattr(torch, dtype))
    prompt = stretched(model.codec.prompt_ids(PROMPT, raw=True), length)

    def timed(tokens: int) -> tuple[float, float, list[int]]:
        gen = Generation(prompt, GenerateParams(max_tokens=tokens), model.codec, (), model.cfg.max_seq_len)
        cache = model.new_cache(gen.capacity)
        start, stamps = clock(), []
        while not gen.done:
            ids, pos = gen.pending()
            gen.accept(model.step(ids, pos, cache))
            stamps.append(clock())
        return stamps[0] - start, stamps[-1] - start, gen.tokens

    timed(4)  # warm-up
    return result(*timed(n), n)


def run_llamacpp(gguf: str, n: int, threads: int, clock, length: int | None = None) -> dict:
    from llama_cpp import Llama

    ctx = max(512, (length or 0) + n + 8)
    llm = Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=ctx, verbose=False)
    prompt = stretched(llm.tokenize(PROMPT.encode(), add_bos=True), length)

    def timed(tokens: int) -> tuple[float, float, list[int]]:
        llm.reset()
        start, stamps, out = clock(), [], []
        for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            stamps.append(clock())
            out.append(tok)
            if len(out) == tokens:
                break
        return stamps[0] - start, stamps[-1] - start, out

    timed(4)
    return result(*timed(n), n)


def run_transformers(gguf: str, dtype: str, n: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    folder, name = gguf.rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]

    def timed(tokens: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return 0.0, time.perf_counter() - start, out[0, ids.shape[1]:].tolist()

    timed(4)
    first = timed(1)[1]
    _, total, tokens = timed(n)
    return result(first, total, tokens, n)


def result(first: float, total: float, tokens: list[int], n: int) -> dict:
    return {"decode_tok_s": (n - 1) / (total - first), "ttft_ms": first * 1e3, "tokens": tokens}


def child(args) -> None:
    clock = CLOCKS[args.clock]
    if args.impl == "prima":
        out = run_prima(args.path, args.dtype, args.tokens, args.threads, clock, args.prompt_tokens)
    elif args.impl == "llama.cpp":
        out = run_llamacpp(args.path, args.tokens, args.threads, clock, args.prompt_tokens)
    else:
        out = run_transformers(args.path, args.dtype, args.tokens, args.threads)
    out["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(out))


def peak_rss_mib() -> float:
    """This process's peak RSS (Linux: VmHWM, which exec resets; ru_maxrss keeps the parent's peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def llama_cpp_ready(mode: str) -> bool:
    if mode == "off":
        return False
    if importlib.util.find_spec("llama_cpp") is None and mode == "install":
        print("installing llama-cpp-python (a source build, ~10 minutes) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-python"], check=True,
                       env={**os.environ, "CMAKE_ARGS": without_amx(cpu_flags())})
    return importlib.util.find_spec("llama_cpp") is not None


# /proc/cpuinfo flags -> ggml's CMake options, for a build of this CPU's instruction sets without AMX
GGML_ISA = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
            "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
            "avx512_bf16": "AVX512_BF16"}


def cpu_flags() -> set[str]:
    try:
        return {f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                for f in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def without_amx(flags: set[str]) -> str:
    """CMAKE_ARGS for llama-cpp-python where the CPU has AMX: ggml's native build then multiplies its quantized
    types in its AMX backend, which crashed (SIGSEGV in ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36) on a
    2-core Xeon VM on every quantized file; the same instruction sets without AMX ran. Elsewhere: native."""
    if "amx_int8" not in flags:
        return os.environ.get("CMAKE_ARGS", "")
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-DGGML_{opt}=ON" for flag, opt in GGML_ISA.items() if flag in flags])


def rows_for(model: str, work: Path, transformers: bool) -> list[tuple[str, str, str, str]]:
    """(label, impl, path, dtype) of every row of one model; stores and GGUFs made when missing."""
    from tools.default_model import default_gguf, ensure_default_store
    from tools.import_gguf import import_gguf

    def store(gguf: Path, dtype: str | None) -> str:  # None: its quantized types kept
        out = work / f"{gguf.stem}-{dtype or 'kept'}"
        if not (out / "manifest.json").is_file():
            import_gguf(gguf, out, dtype=dtype)
        return str(out)

    if model == "smollm2":
        from tools.bench.make_kquants import make_all

        gguf, made = default_gguf(), make_all(work / "smollm2", ("Q8_0", "Q4_0", "Q4_K_M"))  # llama.cpp's quantizer
        rows = [("float32", "prima", str(ensure_default_store()), "float32"),
                ("bfloat16", "prima", str(ensure_default_store()), "bfloat16"),
                ("int8", "prima", str(ensure_default_store(dtype="int8")), "bfloat16"),
                ("int8 f32", "prima", str(ensure_default_store(dtype="int8")), "float32"),  # q4.c's int8 path
                ("int4", "prima", str(ensure_default_store(dtype="int4")), "bfloat16"),
                ("int4 f32", "prima", str(ensure_default_store(dtype="int4")), "float32"),  # q4.c where it builds
                ("int4 f32 q8", "prima", str(ensure_default_store(dtype="int4")), "float32"),  # ggml's Q8_0 mode
                ("Q8_0 f32", "prima", store(made["Q8_0"], None), "float32"),  # each file's types kept
                ("Q4_0 f32", "prima", store(made["Q4_0"], None), "float32"),
                ("Q4_K_M", "prima", store(made["Q4_K_M"], None), "bfloat16"),
                ("Q4_K_M f32", "prima", store(made["Q4_K_M"], None), "float32"),
                ("Q4_1", "llama.cpp", str(gguf), ""),
                ("F32", "llama.cpp", str(made["F32"]), ""),  # the Q4_1 file's weights, as the float32 store's
                ("Q8_0", "llama.cpp", str(made["Q8_0"]), ""),
                ("Q4_0", "llama.cpp", str(made["Q4_0"]), ""),
                ("Q4_K_M", "llama.cpp", str(made["Q4_K_M"]), "")]
        if transformers:
            rows += [("float32", "transformers", str(gguf), "float32"), ("bfloat16", "transformers", str(gguf),
                                                                         "bfloat16")]
        return rows
    from tools.bench.make_gguf import make_gguf
    from tools.bench.make_kquants import make_8b

    ggufs = {"Q4_K_M": make_8b(work)["Q4_K_M"]}  # llama.cpp's Q4_K_M of the Q8_0 file's weights
    for kind in ("Q4_0", "Q8_0"):
        ggufs[kind] = work / f"llama3-8b-4l.{kind}.gguf"
        if not ggufs[kind].is_file():
            make_gguf(ggufs[kind], kind)
    return [("bfloat16", "prima", store(ggufs["Q8_0"], "bfloat16"), "bfloat16"),
            ("int8", "prima", store(ggufs["Q8_0"], "int8"), "bfloat16"),
            ("int8 f32", "prima", store(ggufs["Q8_0"], "int8"), "float32"),
            ("int4", "prima", store(ggufs["Q4_0"], "int4"), "bfloat16"),
            ("int4 f32", "prima", store(ggufs["Q4_0"], "int4"), "float32"),
            ("int4 f32 q8", "prima", store(ggufs["Q4_0"], "int4"), "float32"),
            ("Q4_K_M", "prima", store(ggufs["Q4_K_M"], None), "bfloat16"),
            ("Q4_K_M f32", "prima", store(ggufs["Q4_K_M"], None), "float32"),  # its int4 and int8 layers in q4.c
            ("Q8_0", "llama.cpp", str(ggufs["Q8_0"]), ""),
            ("Q4_0", "llama.cpp", str(ggufs["Q4_0"]), ""),
            ("Q4_K_M", "llama.cpp", str(ggufs["Q4_K_M"]), "")]


# rows run with these variables set: q4.c's activations as ggml's Q8_0 instead of two int8 terms (its default)
ROW_ENV = {"int4 f32 q8": {"PRIMA_INT4_ACTIVATIONS": "q8"}}
# int4 rows by activation dtype: the goals compare the one this machine's measured choice runs
MEASURED = {("int4", "float32"): "int4 f32", ("int8", "float32"): "int8 f32", ("Q4_K_M", "float32"): "Q4_K_M f32"}


def machine_dtype(store_dtype: str) -> str:
    from nodes.engine.dtype_choice import compute_dtype

    if store_dtype == "Q4_K_M":  # mostly int4 layers: their measured choice
        store_dtype = "int4"
    return compute_dtype(store_dtype) if store_dtype in ("int4", "int8") else "float32"


GOALS = {"smollm2": [("int4", "Q4_1", 0.9), ("float32", "F32", 0.9), ("Q8_0 f32", "Q8_0", 0.9),  # issue 26's goal
                     ("Q4_0 f32", "Q4_0", 0.9), ("Q4_K_M", "Q4_K_M", 0.9)],  # for every file (#27: Q4_K_M)
         "8b": [("int4", "Q4_0", 0.9), ("int8", "Q8_0", 0.9), ("Q4_K_M", "Q4_K_M", 0.9)]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "8b"], choices=["smollm2", "8b"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="runs of every row, interleaved; the table shows the best")
    p.add_argument("--llama-cpp", default="auto", choices=["auto", "install", "off"])
    p.add_argument("--transformers", action="store_true", help="also transformers' generate on SmolLM2's GGUF")
    p.add_argument("--work", type=Path, default=None, help="where the 8B-shaped GGUFs and stores go")
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--clock", default="wall", choices=list(CLOCKS), help="cpu: the process's CPU time")
    p.add_argument("--prompt-tokens", type=int, default=None, help="a prompt this long; adds prefill tok/s")
    p.add_argument("--impl", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    return p.parse_args()


def run_row(args: argparse.Namespace, label: str, impl: str, path: str, dtype: str | None) -> dict | str:
    """One row's run in a child process: its figures, or the last line of its error."""
    cmd = [sys.executable, "-m", "tools.bench.bench_decode", "--impl", impl, "--path", path,
           "--tokens", str(args.tokens), "--threads", str(args.threads), "--clock", args.clock] + \
        (["--dtype", dtype] if dtype else []) + \
        (["--prompt-tokens", str(args.prompt_tokens)] if args.prompt_tokens else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ROW_ENV.get(label, {})})
    if out.returncode < 0:  # a crash leaves no message of its own
        return f"failed: killed by {signal.Signals(-out.returncode).name}"
    if out.returncode:
        return f"failed: {out.stderr.strip().splitlines()[-1:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_goals(args: argparse.Namespace, model: str, got: dict) -> None:
    for ours, theirs, goal in GOALS[model]:
        ours = MEASURED.get((ours, machine_dtype(ours)), ours)  # the row of the dtype this machine computes in
        a, b = got.get((ours, "prima")), got.get((theirs, "llama.cpp"))
        if a and b:
            ratio = a["decode_tok_s"] / b["decode_tok_s"]
            print(f"{model}: prima {ours} / llama.cpp {theirs} = {ratio:.2f}x (goal >= {goal}x: "
                  f"{'met' if ratio >= goal else 'not met'})")
            if args.prompt_tokens:
                ratio = b["ttft_ms"] / a["ttft_ms"]
                print(f"{model}: prefill of {args.prompt_tokens} tokens, prima {ours} / llama.cpp {theirs} = "
                      f"{ratio:.2f}x (goal >= 1.0x: {'met' if ratio >= 1.0 else 'not met'})")


def main() -> None:
    from prima_rpc.spec.home import prima_home

    args = parse_args()
    if args.impl:
        return child(args)
    work = args.work or prima_home() / "bench"
    work.mkdir(parents=True, exist_ok=True)
    llama = llama_cpp_ready(args.llama_cpp)
    length = f", {args.prompt_tokens} tokens of it" if args.prompt_tokens else ""
    print(f"{args.tokens} greedy tokens, raw prompt {PROMPT!r}{length}, {args.threads} threads, {args.clock} clock")
    print(f"{'model':8} {'weights':14} {'impl':13} {'decode tok/s':>12} {'TTFT ms':>8} {'peak RSS MiB':>12}"
          + (f" {'prefill tok/s':>13}" if args.prompt_tokens else ""))
    for model in args.models:
        got = {}
        rows = [r for r in rows_for(model, work, args.transformers) if r[1] != "llama.cpp" or llama]
        for rep in range(args.repeats):  # interleaved: a busy spell of a shared machine hits every row alike
            for label, impl, path, dtype in rows:
                r = run_row(args, label, impl, path, dtype)
                if isinstance(r, str):
                    print(f"{model:8} {label:14} {impl:13} {r}")
                    continue
                best = got.get((label, impl))
                if best is None or r["decode_tok_s"] > best["decode_tok_s"]:
                    got[label, impl] = {**r, "ttft_ms": min(r["ttft_ms"], best["ttft_ms"]) if best else r["ttft_ms"]}
                else:
                    best["ttft_ms"] = min(best["ttft_ms"], r["ttft_ms"])  # each figure its best run
                if rep == args.repeats - 1:
                    r = got[label, impl]
                    prefill = f" {args.prompt_tokens / r['ttft_ms'] * 1e3:13.1f}" if args.prompt_tokens else ""
                    print(f"{model:8} {label:14} {impl:13} {r['decode_tok_s']:12.1f} {r['ttft_ms']:8.1f} "
                          f"{r['peak_rss_mib']:12.0f}{prefill}", flush=True)
        print_goals(args, model, got)


if __name__ == "__main__":
    main()
