"""Small GGUF files the importer reads as real ones: one llama layer of seeded float32 weights and SmolLM2's
tokenizer (copied from its GGUF), with or without a chat template."""

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

from tools.default_model import default_gguf

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
HIDDEN, FFN = 64, 128


def small_gguf(path: Path, name: str = "small", chat_template: str | None = None, seed: int = 0) -> Path:
    src = GGUFReader(default_gguf())
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = GGUFWriter(path, "llama")
    w.add_name(name)
    for add, value in (("block_count", 1), ("embedding_length", HIDDEN), ("feed_forward_length", FFN),
                       ("head_count", 4), ("head_count_kv", 4), ("context_length", 256)):
        getattr(w, f"add_{add}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    for key in TOKENIZER_KEYS:
        f = src.fields[key]
        w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    if chat_template:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_v.weight": (HIDDEN, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for tensor, shape in shapes.items():
        norm = len(shape) == 1
        w.add_tensor(tensor, np.ones(shape, np.float32) if norm else
                     (rng.standard_normal(shape) / shape[-1] ** 0.5).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
