"""An 8B-shaped GGUF for side-by-side benchmarks: llama3-8b layer dims, a few layers, seeded random weights
drawn directly as Q4_0 / Q4_1 / Q8_0 blocks (no float copy of the model), SmolLM2's tokenizer.

Both llama.cpp and `prima-ctl import` read the same file.

    python -m tools.bench.make_gguf OUT_DIR [--layers 4] [--types Q4_0 Q8_0]
"""

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from prima_rpc.spec.shapes import PRESETS
from tools.default_model import default_gguf

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.chat_template")
BLOCK = 32


def random_blocks(rng: np.random.Generator, n: int, k: int, kind: str) -> np.ndarray:
    """uint8 [n, k/32 * block bytes]: weights of std ~1/sqrt(k) in GGUF's block layout."""
    g = k // BLOCK
    if kind == "Q8_0":  # d (f16), 32 int8 uniform in [-127, 127] (std ~73)
        d = np.full((n, g, 1), 1 / (73 * k ** 0.5), np.float16).view(np.uint8)
        q = rng.integers(-127, 128, (n, g, BLOCK), dtype=np.int8).view(np.uint8)
        return np.concatenate([d, q], axis=-1).reshape(n, -1)
    d = np.full((n, g, 1), 1 / (4.6 * k ** 0.5), np.float16)  # (q - 8) uniform: std ~4.6
    parts = [d.view(np.uint8)]
    if kind == "Q4_1":
        parts.append((-8 * d).view(np.uint8))
    parts.append(rng.integers(0, 256, (n, g, BLOCK // 2), dtype=np.uint8))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def make_gguf(out: Path, kind: str, layers: int = 4, seed: int = 0) -> Path:
    cfg = PRESETS["llama3-8b"]
    src = GGUFReader(default_gguf())
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = GGUFWriter(out, "llama")
    w.add_name(f"llama3-8b-shaped-{layers}l-{kind}")
    w.add_block_count(layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.intermediate)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(vocab)
    for key in TOKENIZER_KEYS:
        f = src.fields.get(key)
        if f is not None:
            value, vtype = f.contents(), f.types[0]
            sub = f.types[-1] if len(f.types) > 1 else None
            w.add_key_value(key, value, vtype, sub_type=sub)
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    h, q, kv, i = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate

    def matrix(name: str, n: int, k: int) -> None:
        w.add_tensor(name, random_blocks(rng, n, k, kind), raw_dtype=qtype)

    matrix("token_embd.weight", vocab, h)
    for b in range(layers):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(h, np.float32))
        for name, n, k in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q),
                           ("ffn_gate", i, h), ("ffn_up", i, h), ("ffn_down", h, i)):
            matrix(f"blk.{b}.{name}.weight", n, k)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    matrix("output.weight", vocab, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"], choices=["Q4_0", "Q4_1", "Q8_0"])
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in args.types:
        print(make_gguf(args.out / f"llama3-8b-{args.layers}l.{kind}.gguf", kind, args.layers))


if __name__ == "__main__":
    main()
