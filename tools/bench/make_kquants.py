"""SmolLM2 in llama.cpp's quantization types, for the type benchmark: an F32 GGUF de-quantized from the default
model's Q4_1 file (the base, written with gguf's writer), then each type made from it by llama.cpp's own quantizer
(`llama_model_quantize` of llama-cpp-python's libllama, what `llama-quantize` runs). With --8b also an 8B-shaped
Q4_K_M: tools.bench.make_gguf's seeded Q8_0 blocks (4 layers of llama3-8b's dims; that file is the lossless base,
its weights were drawn on Q8_0's grid) re-quantized by llama.cpp.

    python -m tools.bench.make_kquants OUT_DIR [--types Q4_K_M Q5_K_M Q6_K Q8_0 IQ4_XS] [--8b]
"""

import argparse
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, Keys
from gguf.quants import dequantize

from tools.default_model import default_gguf

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q4_0", "Q5_0", "IQ4_NL")


def f32_base(src: Path, out: Path) -> Path:
    """`src` with every tensor de-quantized to F32, its metadata as it is."""
    reader = GGUFReader(src)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    w = GGUFWriter(out, arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in (Keys.General.ARCHITECTURE, Keys.General.FILE_TYPE):
            continue
        w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    w.add_file_type(0)  # all F32
    for t in reader.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def quantize(base: Path, out: Path, kind: str) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = 2
    params.allow_requantize = True  # the 8B-shaped base is Q8_0
    if llama_cpp.llama_model_quantize(str(base).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {base} to {kind}")
    return out


def make_all(out_dir: Path, kinds=TYPES) -> dict[str, Path]:
    """Path of each type's file (and 'F32': the base), made once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / "SmolLM2-135M-Instruct.F32.gguf"
    if not base.is_file():
        f32_base(default_gguf(), base)
    files = {"F32": base}
    for kind in kinds:
        files[kind] = path = out_dir / f"SmolLM2-135M-Instruct.{kind}.gguf"
        if not path.is_file():
            quantize(base, path, kind)
    return files


def make_8b(out_dir: Path, layers: int = 4) -> dict[str, Path]:
    """The 8B-shaped base ('Q8_0') and its Q4_K_M, made once."""
    from tools.bench.make_gguf import make_gguf

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"Q8_0": out_dir / f"llama3-8b-{layers}l.Q8_0.gguf", "Q4_K_M": out_dir / f"llama3-8b-{layers}l.Q4_K_M.gguf"}
    if not files["Q8_0"].is_file():
        make_gguf(files["Q8_0"], "Q8_0", layers)
    if not files["Q4_K_M"].is_file():
        quantize(files["Q8_0"], files["Q4_K_M"], "Q4_K_M")
    return files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--types", nargs="+", default=list(TYPES[:5]), choices=TYPES)
    p.add_argument("--8b", dest="eight_b", action="store_true", help="also the 8B-shaped Q4_K_M")
    args = p.parse_args()
    made = {**make_all(args.out, args.types), **({f"8b {k}": v for k, v in make_8b(args.out).items()}
                                                  if args.eight_b else {})}
    for kind, path in made.items():
        types = sorted({t.tensor_type.name for t in GGUFReader(path).tensors})
        print(f"{kind}: {path} ({path.stat().st_size / 1e6:.1f} MB; {', '.join(types)})")


if __name__ == "__main__":
    main()
