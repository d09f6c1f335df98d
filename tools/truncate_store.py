"""A draft model for speculative decoding: a store's first N layers (and its embedding, output head and
tokenizer) as a store of its own.

    python -m tools.truncate_store SRC OUT --layers N [--overwrite]

Units are copied byte for byte (any dtype, quantized too); only the manifest's layer count changes.
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from nodes.engine.store import LayerStore
from prima_rpc.spec.manifest import Manifest, StoreError
from tools.store_writer import StoreWriter


def truncate_store(src: Path, out: Path, layers: int, *, overwrite: bool = False) -> Manifest:
    store = LayerStore(src)
    m = store.manifest
    if not 1 <= layers <= m.config.n_layers:
        raise StoreError(f"--layers must be in [1, {m.config.n_layers}] for {m.name}, got {layers}")
    if m.manifest_only:
        raise StoreError(f"{src} is manifest-only: it has no weights to copy")
    units = m.units()
    with StoreWriter(out, overwrite=overwrite) as w:
        for unit in ["embed", "head", *(f"layer.{i}" for i in range(layers))]:
            w.write_raw(unit, (store.root / units[unit].path).read_bytes(), units[unit].format)
        tok = store.tokenizer_path()
        if tok is not None:
            w.add_file(m.tokenizer, tok.read_bytes())
        # what is per layer keeps the first N: an int4 store's int8 matrices of each layer, the windowed layers
        config = replace(m.config, n_layers=layers, local_layers=tuple(i for i in m.config.local_layers if i < layers))
        quant = {**m.quant, "int8_layers": m.quant["int8_layers"][:layers]} if "int8_layers" in m.quant else m.quant
        return w.finish(name=f"{m.name}-first{layers}", config=config, dtype=m.dtype,
                        bits_per_weight=m.bits_per_weight, tokenizer=m.tokenizer, chat_template=m.chat_template,
                        bos_token_id=m.bos_token_id, eos_token_ids=m.eos_token_ids, add_bos=m.add_bos,
                        quant=quant, extra=m.extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args()
    try:
        truncate_store(args.src, args.out, args.layers, overwrite=args.overwrite)
    except (StoreError, OSError) as exc:
        sys.exit(f"error: {exc}")
    print(args.out)


if __name__ == "__main__":
    main()
