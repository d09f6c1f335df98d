"""Import a Llama-family GGUF file (de-quantized with the `gguf` package) into a layer store."""

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from nodes.config import ModelConfig, StoreError
from tools.gguf_tokenizer import build_tokenizer
from tools.store_writer import StoreWriter

ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "wq.weight", "attn_k.weight": "wk.weight", "attn_v.weight": "wv.weight",
    "attn_q.bias": "wq.bias", "attn_k.bias": "wk.bias", "attn_v.bias": "wv.bias",
    "attn_output.weight": "wo.weight", "ffn_gate.weight": "w_gate.weight",
    "ffn_up.weight": "w_up.weight", "ffn_down.weight": "w_down.weight",
}
REQUIRED = [n for n in LAYER_NAMES.values() if not n.endswith(".bias")]


def field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise StoreError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) back to rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_config(reader: GGUFReader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in ARCHS:
        raise StoreError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHS)}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise StoreError("GGUF files with rope_freqs (llama3 rope scaling) are not supported yet; "
                         "import the Hugging Face directory instead")
    hidden, heads = int(field(reader, f"{arch}.embedding_length")), int(field(reader, f"{arch}.attention.head_count"))
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise StoreError("GGUF file has no token_embd.weight tensor")
    return ModelConfig(
        architecture=ARCHS[arch], hidden=hidden,
        intermediate=int(field(reader, f"{arch}.feed_forward_length")),
        n_layers=int(field(reader, f"{arch}.block_count")), n_heads=heads,
        n_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        vocab=int(embed.shape[1]), max_seq_len=int(field(reader, f"{arch}.context_length", 4096)),
        norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        qkv_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )


def import_gguf(src: Path, out: Path, *, dtype: str = "float32", overwrite: bool = False,
                progress: Callable[[int, int], None] = lambda done, total: None) -> Path:
    try:
        reader = GGUFReader(src)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise StoreError(f"{src}: not a readable GGUF file ({exc})") from None
    cfg = read_config(reader)
    torch_dtype = getattr(torch, dtype)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise StoreError(f"GGUF file lacks tensor {name!r}")
        t = tensors[name]
        try:
            values = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise StoreError(f"tensor {name}: cannot de-quantize {t.tensor_type.name} ({exc})") from None
        return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).to(torch_dtype)

    permute = cfg.architecture in ("llama", "mistral")
    with StoreWriter(out, overwrite=overwrite) as w:
        w.write_unit("embed", {"embed.weight": get("token_embd.weight")})
        for i in range(cfg.n_layers):
            unit = {}
            for gname, name in LAYER_NAMES.items():
                full = f"blk.{i}.{gname}"
                if full not in tensors:
                    if name in REQUIRED:
                        raise StoreError(f"GGUF file lacks tensor {full!r}")
                    continue
                t = get(full)
                if permute and gname == "attn_q.weight":
                    t = unpermute(t, cfg.n_heads)
                elif permute and gname == "attn_k.weight":
                    t = unpermute(t, cfg.n_kv_heads)
                unit[name] = t
            w.write_unit(f"layer.{i}", unit)
            progress(i + 1, cfg.n_layers)
        head = {"norm.weight": get("output_norm.weight")}
        if not cfg.tie_embeddings:
            head["output.weight"] = get("output.weight")
        w.write_unit("head", head)

        tok = build_tokenizer(
            field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre", "default"),
            field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type", [1]),
            field(reader, "tokenizer.ggml.merges"),
        )
        w.add_file("tokenizer.json", tok.to_str().encode())
        eos = int(field(reader, "tokenizer.ggml.eos_token_id"))
        eot = reader.fields.get("tokenizer.ggml.eot_token_id")
        bos = reader.fields.get("tokenizer.ggml.bos_token_id")
        w.finish(
            name=str(field(reader, "general.name", src.stem)), config=cfg, dtype=dtype,
            tokenizer="tokenizer.json", chat_template=field(reader, "tokenizer.chat_template", ""),
            bos_token_id=int(bos.contents()) if bos else None,
            # The model's EOS first: the chat template renders eos_ids[0] as {{ eos_token }}.
            eos_token_ids=(eos,) + ((int(eot.contents()),) if eot and int(eot.contents()) != eos else ()),
            add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        )
    return out
