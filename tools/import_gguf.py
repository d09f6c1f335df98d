"""Import a Llama-family GGUF file into a layer store: float (de-quantized with the `gguf` package), or
quantized, where Q4_0/Q4_1 blocks become int4 exactly and other tensors are quantized (nodes/engine/quant.py)."""

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from nodes.engine.quant import GROUP, Format, gguf_q4, pack_int4, quantize_int4, writing_format
from prima_rpc.spec.manifest import DTYPES, ModelConfig, StoreError
from prima_rpc.spec.shapes import FUSED as SHAPES_FUSED
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
# A quantized store's fused matrices (prima_rpc.spec.shapes.FUSED): their GGUF parts, in row order.
GGUF_NAME = {store: gguf.removesuffix(".weight") for gguf, store in LAYER_NAMES.items()}
FUSED = {unit: tuple(GGUF_NAME[f"{p}.weight"] for p in parts) for unit, parts in SHAPES_FUSED.items()}
EXACT_INT4 = ("Q4_0", "Q4_1")  # GGUF types whose blocks are the int4 kernel's groups (d, m) as they are


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


class GgufTensors:
    """The GGUF file's tensors as a store holds them: de-quantized floats (`dtype`: norms and biases, and every
    tensor of a float store), or a quantized store's fused matrices (int4 from Q4 blocks exactly); Q/K rows back in
    rotate-half order."""

    def __init__(self, src: Path, reader: GGUFReader, cfg: ModelConfig, fmt: Format | None, dtype: torch.dtype):
        self.src, self.cfg, self.fmt, self.dtype = src, cfg, fmt, dtype
        self.tensors = {t.name: t for t in reader.tensors}
        self.permute = cfg.architecture in ("llama", "mistral")

    def tensor(self, name: str):
        if name not in self.tensors:
            raise StoreError(f"{self.src}: GGUF file lacks tensor {name!r}")
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor:
        t = self.tensor(name)
        try:
            values = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise StoreError(f"{self.src}: tensor {name}: cannot de-quantize {t.tensor_type.name} ({exc})") from None
        return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).to(self.dtype)

    def heads(self, gname: str) -> int | None:
        """The heads whose rows llama.cpp permuted for its interleaved RoPE (None: not permuted)."""
        return {"attn_q": self.cfg.n_heads, "attn_k": self.cfg.n_kv_heads}.get(gname) if self.permute else None

    def matrix(self, name: str, parts: list[tuple[str, int | None]], fmt: Format) -> dict[str, torch.Tensor]:
        """A quantized store's matrix `name` from GGUF tensors stacked by rows (each unpermuted if asked)."""
        if fmt.name == "int4":
            qs, dms = zip(*(self.int4_values(self.tensor(g), h) for g, h in parts))
            return {f"{name}.qweight": pack_int4(torch.cat(qs), fmt.layout), f"{name}.scales": torch.cat(dms, dim=1)}
        w = torch.cat([unpermute(self.get(g), h) if h else self.get(g) for g, h in parts])
        q, scale = fmt.encode(w)
        return {f"{name}.qweight": q, f"{name}.scales": scale}

    def int4_values(self, t, n_heads: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = int(t.shape[1]), int(t.shape[0])
        if k % GROUP:
            raise StoreError(f"{self.src}: tensor {t.name} has rows of {k} values, int4 needs a multiple of {GROUP}")
        if t.tensor_type.name in EXACT_INT4:
            q, dm = gguf_q4(t.data, t.tensor_type.name, n, k)
        else:
            q, dm = quantize_int4(self.get(t.name))
        if n_heads:
            q, dm = unpermute(q, n_heads), unpermute(dm.transpose(0, 1), n_heads).transpose(0, 1)
        return q, dm.contiguous()

    def outer(self, name: str) -> Format | None:
        """The embedding's and output's format: int4 only from Q4 blocks; else int8 (measured on SmolLM2's Q8_0
        embedding, which is also its output: int4 groups err by 9 % of its norm and lose "Paris", int8 rows 1.2 %)."""
        if self.fmt and self.fmt.name == "int4" and self.tensor(name).tensor_type.name not in EXACT_INT4:
            return Format("int8")
        return self.fmt


def open_gguf(src: Path) -> GGUFReader:
    try:
        return GGUFReader(src)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise StoreError(f"{src}: not a readable GGUF file ({exc})") from None


def embed_unit(g: GgufTensors) -> tuple[dict[str, torch.Tensor], str]:
    """The embed unit's tensors and format."""
    if not g.fmt:
        return {"embed.weight": g.get("token_embd.weight")}, ""
    f = g.outer("token_embd.weight")
    return g.matrix("embed", [("token_embd.weight", None)], f), f.name


def layer_unit(g: GgufTensors, i: int) -> dict[str, torch.Tensor]:
    """Layer i's tensors under the store's names: norms and biases, and its matrices (fused when quantized)."""
    unit = {}
    for gname, name in LAYER_NAMES.items():
        full = f"blk.{i}.{gname}"
        if full not in g.tensors:
            if name in REQUIRED:
                raise StoreError(f"{g.src}: GGUF file lacks tensor {full!r}")
            continue
        if g.fmt and name.endswith(".weight") and "norm" not in name:
            continue  # matrices: fused below
        t = g.get(full)
        h = g.heads(gname.split(".")[0])
        unit[name] = unpermute(t, h) if h and name.endswith(".weight") else t
    if g.fmt:
        for fused, parts in FUSED.items():
            unit.update(g.matrix(fused, [(f"blk.{i}.{p}.weight", g.heads(p)) for p in parts], g.fmt))
    return unit


def head_unit(g: GgufTensors) -> tuple[dict[str, torch.Tensor], str]:
    """The head unit's tensors (final norm; output unless tied) and format."""
    head = {"norm.weight": g.get("output_norm.weight")}
    f = g.outer("output.weight") if g.fmt and not g.cfg.tie_embeddings else g.fmt
    if not g.cfg.tie_embeddings:
        out_w = g.matrix("output", [("output.weight", None)], f) if f else {"output.weight": g.get("output.weight")}
        head.update(out_w)
    return head, f.name if f else ""


def tokenizer_json(reader: GGUFReader) -> bytes:
    tok = build_tokenizer(
        field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre", "default"),
        field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type", [1]),
        field(reader, "tokenizer.ggml.merges"),
    )
    return tok.to_str().encode()


def manifest_fields(reader: GGUFReader, src: Path, cfg: ModelConfig, dtype: str, fmt: Format | None) -> dict:
    """StoreWriter.finish's fields: name, shape, dtype, tokenizer and its special tokens, quantization."""
    eos = int(field(reader, "tokenizer.ggml.eos_token_id"))
    eot = reader.fields.get("tokenizer.ggml.eot_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    return dict(
        name=str(field(reader, "general.name", src.stem)), config=cfg, dtype=dtype,
        tokenizer="tokenizer.json", chat_template=field(reader, "tokenizer.chat_template", ""),
        bos_token_id=int(bos.contents()) if bos else None,
        # The model's EOS first: the chat template renders eos_ids[0] as {{ eos_token }}.
        eos_token_ids=(eos,) + ((int(eot.contents()),) if eot and int(eot.contents()) != eos else ()),
        add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        quant=fmt.manifest() if fmt else {},
    )


def import_gguf(src: Path, out: Path, *, dtype: str = "float32", overwrite: bool = False,
                progress: Callable[[int, int], None] = lambda done, total: None) -> Path:
    if dtype not in DTYPES:
        raise StoreError(f"unknown dtype {dtype!r}; stores hold {', '.join(DTYPES)}")
    reader = open_gguf(src)
    cfg = read_config(reader)
    fmt = writing_format(dtype)
    # norms and biases of quantized stores: float32
    g = GgufTensors(src, reader, cfg, fmt, torch.float32 if fmt else getattr(torch, dtype))
    with StoreWriter(out, overwrite=overwrite) as w:
        w.write_unit("embed", *embed_unit(g))
        for i in range(cfg.n_layers):
            w.write_unit(f"layer.{i}", layer_unit(g, i))
            progress(i + 1, cfg.n_layers)
        w.write_unit("head", *head_unit(g))
        w.add_file("tokenizer.json", tokenizer_json(reader))
        w.finish(**manifest_fields(reader, src, cfg, dtype, fmt))
    return out
