"""Import a Llama-family GGUF file into a layer store: float (de-quantized with the `gguf` package), or
quantized, where Q4_0/Q4_1/Q4_K blocks become int4 as they are and other types int8 rows (tools/gguf_types.py), each
layer's matrices in the format of that layer's types."""

import re
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_TENSOR, GGMLQuantizationType, GGUFReader, Keys
from gguf.quants import dequantize

from nodes.engine.formats import Format, writing_format
from nodes.engine.fused import piece_shapes
from nodes.engine.quant import BITS, GROUP, pack_int4, quantize_int4
from prima_rpc.spec.manifest import DTYPES, ModelConfig, StoreError, expert_unit
from prima_rpc.spec.shapes import FUSED as SHAPES_FUSED
from prima_rpc.spec.shapes import layer_shapes, matrix_shapes
from tools import gguf_moe
from tools.chat_templates import family_template
from tools.gguf_config import field, read_config
from tools.gguf_names import tensor_name
from tools.gguf_tokenizer import build_tokenizer
from tools.gguf_types import FLOAT_TYPES, INT4_EXACT, TypeReport, int4_blocks, store_format
from tools.store_writer import StoreWriter

# llama.cpp's tensors inside blk.{i} -> the store's names.
LAYER_TENSORS = {
    MODEL_TENSOR.ATTN_NORM: "attn_norm", MODEL_TENSOR.FFN_NORM: "ffn_norm", MODEL_TENSOR.ATTN_Q: "wq",
    MODEL_TENSOR.ATTN_K: "wk", MODEL_TENSOR.ATTN_V: "wv", MODEL_TENSOR.ATTN_OUT: "wo", MODEL_TENSOR.FFN_GATE: "w_gate",
    MODEL_TENSOR.FFN_UP: "w_up", MODEL_TENSOR.FFN_DOWN: "w_down", MODEL_TENSOR.ATTN_Q_NORM: "q_norm",
    MODEL_TENSOR.ATTN_K_NORM: "k_norm", MODEL_TENSOR.ATTN_POST_NORM: "post_attn_norm",
    MODEL_TENSOR.FFN_POST_NORM: "post_ffn_norm",
}
GGUF_TENSOR = {store: t for t, store in LAYER_TENSORS.items()}
EMBED, OUTPUT_NORM, OUTPUT = (tensor_name(t) for t in (MODEL_TENSOR.TOKEN_EMBD, MODEL_TENSOR.OUTPUT_NORM,
                                                       MODEL_TENSOR.OUTPUT))


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) back to rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GgufTensors:
    """The GGUF file's tensors as a store holds them: de-quantized floats (`dtype`: norms and biases, and every
    tensor of a float store), or a quantized store's fused matrices (int4 from Q4 blocks as they are); Q/K rows back
    in rotate-half order. `report` counts what each GGUF type became."""

    def __init__(self, src: Path, reader: GGUFReader, cfg: ModelConfig, fmt: Format | None, dtype: torch.dtype):
        self.src, self.cfg, self.fmt, self.dtype = src, cfg, fmt, dtype
        self.tensors = {t.name: t for t in reader.tensors}
        self.permute = cfg.arch.gguf_permuted_qk
        self.report = TypeReport()

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

    def float_tensor(self, name: str) -> torch.Tensor:
        """A float store's matrix (counted in the report)."""
        t = self.tensor(name)
        self.report.add(t.tensor_type.name, int(t.n_elements), str(self.dtype).removeprefix("torch."))
        return self.get(name)

    def heads(self, name: str, i: int) -> int | None:
        """The heads whose rows llama.cpp permuted for its interleaved RoPE in layer i's tensor `name` (None: not
        permuted)."""
        if not self.permute:
            return None
        return {tensor_name(MODEL_TENSOR.ATTN_Q, i): self.cfg.n_heads,
                tensor_name(MODEL_TENSOR.ATTN_K, i): self.cfg.n_kv_heads}.get(name)

    def matrix(self, name: str, parts: list[tuple[str, int | None]], fmt: Format) -> dict[str, torch.Tensor]:
        """A quantized store's matrix `name` from GGUF tensors stacked by rows (each unpermuted if asked)."""
        for g, _ in parts:
            t = self.tensor(g)
            self.report.add(t.tensor_type.name, int(t.n_elements), fmt.name)
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
        if t.tensor_type.name in INT4_EXACT:
            try:
                q, dm = int4_blocks(t.tensor_type.name, t.data, n, k)
            except ValueError as exc:
                raise StoreError(f"{self.src}: tensor {t.name}: {exc}") from None
        else:
            q, dm = quantize_int4(self.get(t.name))
        if n_heads:
            q, dm = unpermute(q, n_heads), unpermute(dm.transpose(0, 1), n_heads).transpose(0, 1)
        return q, dm.contiguous()

    def outer(self, name: str) -> Format | None:
        """The embedding's and output's format: int4 only from Q4 blocks; else int8 (measured on SmolLM2's Q8_0
        embedding, which is also its output: int4 groups err by 9 % of its norm and lose "Paris", int8 rows 1.2 %)."""
        if self.fmt and self.fmt.name == "int4" and self.tensor(name).tensor_type.name not in INT4_EXACT:
            return Format("int8")
        return self.fmt


class Truncated(ValueError):
    """A read past the end of the file: it was cut short."""


class CheckedReader(GGUFReader):
    """GGUFReader that names a read past the end of the file (a download cut short) instead of failing later
    with numpy's reshape message."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if offset + np.dtype(dtype).itemsize * int(count) > len(self.data):
            raise Truncated(f"the file is truncated: it ends at byte {len(self.data):,}, before the data its "
                            "header describes")
        return super()._get(offset, dtype, count, override_order)


def open_gguf(src: Path) -> GGUFReader:
    try:
        return CheckedReader(src)
    except Truncated as exc:
        raise StoreError(f"{src}: {exc} (download it again, or join all of its parts)") from None
    except (ValueError, OSError, IndexError, KeyError) as exc:
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
        if unknown:  # a newer llama.cpp's type: the reader fails before naming the tensor
            raise StoreError(f"{src}: a tensor of GGUF type {unknown[1]}, unknown to the gguf package "
                             f"{version('gguf')} (types known: up to {max(GGMLQuantizationType).value})") from None
        raise StoreError(f"{src}: not a readable GGUF file ({exc})") from None


def embed_unit(g: GgufTensors) -> tuple[dict[str, torch.Tensor], str]:
    """The embed unit's tensors and format."""
    if not g.fmt:
        return {"embed.weight": g.float_tensor(EMBED)}, ""
    f = g.outer(EMBED)
    return g.matrix("embed", [(EMBED, None)], f), f.name


def matrix_parts(g: GgufTensors, i: int) -> dict[str, list[str]]:
    """Each of the store's fused matrices of layer i (shapes.FUSED): its GGUF tensors, in row order (Phi-3's files
    hold wqkv and w_gate_up fused already: one tensor each)."""
    def names(*parts: str) -> list[str]:
        return [tensor_name(GGUF_TENSOR[p], i) for p in parts]

    qkv = tensor_name(MODEL_TENSOR.ATTN_QKV, i)  # Phi-3: q, k, v fused by rows
    fused_qkv, has_gate = qkv in g.tensors, names("w_gate")[0] in g.tensors
    mlp = {"w_gate_up": names("w_gate", "w_up") if has_gate else names("w_up"), "w_down": names("w_down")}
    return {"wqkv": [qkv] if fused_qkv else names("wq", "wk", "wv"), "wo": names("wo"),
            **({} if g.cfg.moe else mlp)}  # a mixture's: tools/gguf_moe.py


def layer_unit(g: GgufTensors, i: int) -> dict[str, torch.Tensor]:
    """Layer i's tensors under the store's names: norms and biases, and its matrices (fused when quantized)."""
    shapes = layer_shapes(g.cfg)
    unit = {}
    for name in (n.removesuffix(".weight") for n in shapes if n.endswith("norm.weight")):
        unit[f"{name}.weight"] = g.get(tensor_name(GGUF_TENSOR[name], i))
    if g.cfg.qkv_bias:
        unit.update({f"{p}.bias": g.get(tensor_name(GGUF_TENSOR[p], i, "bias")) for p in ("wq", "wk", "wv")})
    if g.cfg.moe:
        unit.update(gguf_moe.dense_tensors(g, i))
    for fused, parts in matrix_parts(g, i).items():
        heads = [g.heads(p, i) for p in parts]
        if g.fmt:
            pieces, tensors = g.fmt.layer(i).pieces(fused), list(zip(parts, heads, strict=True))
            for p in pieces:  # a matrix of pieces has a GGUF tensor a part (file_dtype)
                own = tensors if len(pieces) == 1 else [tensors[SHAPES_FUSED[fused].index(n)] for n in p.parts]
                unit.update(g.matrix(p.name, own, p.fmt))
            continue
        t = torch.cat([unpermute(g.float_tensor(p), h) if h else g.float_tensor(p)
                       for p, h in zip(parts, heads, strict=True)])
        names = [f"{n}.weight" for n in SHAPES_FUSED[fused]]
        rows = [shapes[n][0] for n in names]
        if t.shape[0] != sum(rows):
            raise StoreError(f"{g.src}: layer {i}'s {' + '.join(parts)} has {t.shape[0]} rows; expected {sum(rows)}")
        unit.update(zip(names, (r.contiguous() for r in t.split(rows)), strict=True))
    return unit


def head_unit(g: GgufTensors) -> tuple[dict[str, torch.Tensor], str]:
    """The head unit's tensors (final norm; output unless tied) and format."""
    head = {"norm.weight": g.get(OUTPUT_NORM)}
    f = g.outer(OUTPUT) if g.fmt and not g.cfg.tie_embeddings else g.fmt
    if not g.cfg.tie_embeddings:
        head.update(g.matrix("output", [(OUTPUT, None)], f) if f
                    else {"output.weight": g.float_tensor(OUTPUT)})
    return head, f.name if f else ""


def tokenizer_json(reader: GGUFReader) -> bytes:
    tok = build_tokenizer(
        field(reader, Keys.Tokenizer.MODEL), field(reader, Keys.Tokenizer.PRE, "default"),
        field(reader, Keys.Tokenizer.LIST), field(reader, Keys.Tokenizer.TOKEN_TYPE, [1]),
        field(reader, Keys.Tokenizer.MERGES, []), field(reader, Keys.Tokenizer.SCORES, []),
        bool(field(reader, Keys.Tokenizer.ADD_PREFIX, True)),
    )
    return tok.to_str().encode()


def file_dtype(g: GgufTensors) -> tuple[str, tuple[tuple[str, ...], ...]]:
    """The store dtype (and int4's int8 matrices of each layer) that keeps the file's types: float32 for a file of
    float matrices; int4 where a tensor is INT4_EXACT, int8 rows for the others, layer by layer and part by part (a
    Q4_K_M file's Q6_K attn_v makes wqkv's v rows int8 in the layers that have it only, its q and k rows int4);
    int8 when no matrix is int4 in any layer."""
    types = [{fused: [g.tensor(n).tensor_type.name for n in names] for fused, names in matrix_parts(g, i).items()}
             for i in range(g.cfg.n_layers)]
    if all(set(t) <= FLOAT_TYPES.keys() for layer in types for t in layer.values()):
        return "float32", ()
    int8 = tuple(tuple(n for fused, ts in layer.items() for n in int8_names(fused, ts)) for layer in types)
    return ("int8", ()) if all(set(m) == layer.keys() for m, layer in zip(int8, types)) else ("int4", int8)


def int8_names(fused: str, types: list[str]) -> tuple[str, ...]:
    """What of the fused matrix `fused`, of GGUF tensors of `types` (in row order), is int8: all of it, none, or the
    parts (shapes.FUSED) whose tensors are (where each part is a tensor of its own: not Phi-3's fused attn_qkv)."""
    int8 = [store_format(t) == "int8" for t in types]
    if all(int8) or (any(int8) and len(types) != len(SHAPES_FUSED[fused])):
        return (fused,)
    return tuple(p for p, is_int8 in zip(SHAPES_FUSED[fused], int8) if is_int8)


def manifest_fields(reader: GGUFReader, src: Path, cfg: ModelConfig, dtype: str, fmt: Format | None) -> dict:
    """StoreWriter.finish's fields: shape, dtype, tokenizer and its special tokens, quantization."""
    eos = int(field(reader, Keys.Tokenizer.EOS_ID))
    eot = reader.fields.get(Keys.Tokenizer.EOT_ID)
    bos = reader.fields.get(Keys.Tokenizer.BOS_ID)
    return dict(
        config=cfg, dtype=dtype,
        tokenizer="tokenizer.json", chat_template=gguf_chat_template(reader, src),
        bos_token_id=int(bos.contents()) if bos else None,
        # The model's EOS first: the chat template renders eos_ids[0] as {{ eos_token }}.
        eos_token_ids=(eos,) + ((int(eot.contents()),) if eot and int(eot.contents()) != eos else ()),
        add_bos=bool(field(reader, Keys.Tokenizer.ADD_BOS, False)),
        quant=fmt.manifest() if fmt else {},
        bits_per_weight=layer_bits(cfg, fmt) if fmt else None,
        sampling=gguf_sampling(reader),
    )


# llama.cpp's general.sampling.* keys -> the manifest's sampling names (nodes/generation/sampling.py's DEFAULTS)
SAMPLING_KEYS = {Keys.General.SAMPLING_TEMP: "temperature", Keys.General.SAMPLING_TOP_K: "top_k",
                 Keys.General.SAMPLING_TOP_P: "top_p", Keys.General.SAMPLING_MIN_P: "min_p",
                 Keys.General.SAMPLING_PENALTY_REPEAT: "repeat_penalty",
                 Keys.General.SAMPLING_PENALTY_LAST_N: "repeat_last_n"}


def gguf_sampling(reader: GGUFReader) -> dict:
    """The sampling settings the file's maker recommends, where it names any."""
    return {name: field(reader, key) for key, name in SAMPLING_KEYS.items() if key in reader.fields}


def gguf_chat_template(reader: GGUFReader, src: Path) -> str:
    """The file's chat template, else its family's where that is certain (tools/chat_templates.py), else "" (a
    base model)."""
    own = field(reader, Keys.Tokenizer.CHAT_TEMPLATE, "")
    if own:
        return own
    names = [str(field(reader, k, "")) for k in (Keys.General.NAME, Keys.General.FINETUNE)] + [src.stem]
    return family_template(str(field(reader, Keys.General.ARCHITECTURE)), names,
                           set(field(reader, Keys.Tokenizer.LIST, []))) or ""


def layer_bits(cfg: ModelConfig, fmt: Format) -> float:
    """Bits per weight of the layers' matrices on disk, each piece in its layer's format."""
    shapes = layer_shapes(cfg)
    bits = sum(BITS[p.fmt.name] * n * k for i in range(cfg.n_layers) for u in matrix_shapes(cfg)
               for p, (n, k) in piece_shapes(u, fmt.layer(i), shapes))
    return bits / (cfg.n_layers * sum(n * k for n, k in matrix_shapes(cfg).values()))


def import_gguf(src: Path, out: Path, *, dtype: str | None = None, name: str | None = None, overwrite: bool = False,
                progress: Callable[[int, int], None] = lambda done, total: None,
                log: Callable[[str], None] = lambda line: None, chat_template: str | None = None) -> Path:
    """dtype None: keep the file's types (file_dtype); name: the store's (None: the directory's); log: one line per
    GGUF type, what it became; chat_template: the store's (None: the file's, else its family's, gguf_chat_template)."""
    if dtype is not None and dtype not in DTYPES:
        raise StoreError(f"unknown dtype {dtype!r}; stores hold {', '.join(DTYPES)}")
    reader = open_gguf(src)
    cfg = read_config(reader, src)
    g = GgufTensors(src, reader, cfg, None, torch.float32)
    dtype, int8 = (dtype, ()) if dtype else file_dtype(g)
    # norms and biases of quantized stores: float32
    g.fmt = fmt = writing_format(dtype, int8)
    g.dtype = torch.float32 if fmt else getattr(torch, dtype)
    with StoreWriter(out, overwrite=overwrite) as w:
        w.write_unit("embed", *embed_unit(g))
        for i in range(cfg.n_layers):
            w.write_unit(f"layer.{i}", layer_unit(g, i))
            if cfg.moe:
                gguf_moe.add_expert_slices(g, i)
                for e in range(cfg.n_experts):
                    w.write_unit(expert_unit(i, e), gguf_moe.expert_tensors(g, i, e))
            progress(i + 1, cfg.n_layers)
        w.write_unit("head", *head_unit(g))
        w.add_file("tokenizer.json", tokenizer_json(reader))
        fields = manifest_fields(reader, src, cfg, dtype, fmt)
        w.finish(name=name or Path(out).resolve().name, **{**fields, "chat_template": chat_template or
                                                            fields["chat_template"]})
    for line in g.report.lines():
        log(line)
    return out
