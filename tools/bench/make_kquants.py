"""SmolLM2 in llama.cpp's quantization types, for the type benchmark: an F32 GGUF de-quantized from the default
model's Q4_1 file (the base, written with gguf's writer), then each type made from it by llama.cpp's own quantizer
(`llama_model_quantize` of llama-cpp-python's libllama, what `llama-quantize` runs).

    python -m tools.bench.make_kquants OUT_DIR [--types Q4_K_M Q5_K_M Q6_K Q8_0 IQ4_XS]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--types", nargs="+", default=list(TYPES[:5]), choices=TYPES)
    for kind, path in make_all(p.parse_args().out, p.parse_args().types).items():
        types = sorted({t.tensor_type.name for t in GGUFReader(path).tensors})
        print(f"{kind}: {path} ({path.stat().st_size / 1e6:.1f} MB; {', '.join(types)})")


if __name__ == "__main__":
    main()
