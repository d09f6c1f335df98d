"""Synthetic layer stores: real Llama-family shapes, seeded random weights, streamed to disk unit by unit."""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from nodes.engine.formats import Format, writing_format
from nodes.engine.quant import BITS, GROUP
from prima_rpc.spec.manifest import DTYPES, FileEntry, ModelConfig, StoreError
from prima_rpc.spec.shapes import PRESETS, expert_matrix_shapes, matrix_shapes, unit_shapes
from tools.store_writer import StoreWriter, unit_file

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer() -> Tokenizer:
    """Byte-level tokens with no merges: any text round-trips; ids 0-2 are the chat specials."""
    alphabet = sorted(ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


FLOAT_MATRICES = ("router.weight", "shared_gate.weight")  # quantized stores keep them float32 (store_writer)


def random_unit(shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            # std 1/sqrt(fan_in) keeps activations O(1) through many layers, so logits stay finite.
            std = 1.0 / (shape[-1] ** 0.5) if len(shape) == 2 else 0.02
            out[name] = (torch.randn(shape, generator=g) * std).to(dtype)
    return out


def random_quantized(unit: str, cfg: ModelConfig, fmt: Format, seed: int, fill: bool = True) -> dict[str, torch.Tensor]:
    """A unit of a quantized store: norms of ones (float32) and random quantized matrices of std ~1/sqrt(K),
    drawn as stored values directly (a 70B layer is 0.5 GB of int4: no float copy of it is ever made).
    fill=False: values left as they come (for sizes only)."""
    g = torch.Generator().manual_seed(seed)
    randint = (lambda lo, hi, shape, dtype, generator: torch.empty(shape, dtype=dtype)) if not fill else torch.randint
    tensors = unit_shapes(cfg)[unit]
    if ".expert." in unit:
        shapes = expert_matrix_shapes(cfg)  # an expert's fused matrices
    elif unit.startswith("layer."):
        shapes = matrix_shapes(cfg)  # quantized layers hold fused matrices
    else:
        shapes = {name.removesuffix(".weight"): s for name, s in tensors.items() if len(s) == 2}
    out = {}
    for name, (n, k) in shapes.items():
        if fmt.name == "int4":  # q uniform in [0, 16): (q - 7.5) has mean 0 and std ~4.6
            # (mean 0: an offset of -8 d gave every matrix a common -0.5 d, a direction that outgrew the rest of the
            # hidden state, so that a mixture's router chose the same experts for every token)
            d = torch.full((k // GROUP, n), 1 / (4.6 * k ** 0.5)).half()
            out[f"{name}.qweight"] = randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            out[f"{name}.scales"] = torch.stack([d, -7.5 * d], dim=-1)
        else:  # uniform in [-127, 127]: std ~73
            out[f"{name}.qweight"] = randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            out[f"{name}.scales"] = torch.full((n,), 1 / (73 * k ** 0.5))
    for name, shape in tensors.items():  # norms (ones) and biases, in float32
        if len(shape) == 1:
            out[name] = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
        elif name in FLOAT_MATRICES:  # a mixture's router and shared-expert gate stay float
            out[name] = torch.randn(shape, generator=g) / shape[-1] ** 0.5
    return out


def synth(out: Path, preset: str, *, seed: int = 0, dtype: str = "float32", bits_per_weight: float | None = None,
          manifest_only: bool = False, overwrite: bool = False, layers: int | None = None,
          progress: Callable[[int, int], None] = lambda done, total: None,
          chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """chat_template None: a base model's store (chats are plain completion)."""
    if preset not in PRESETS:
        raise StoreError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise StoreError(f"unknown dtype {dtype!r}; stores hold {', '.join(DTYPES)}")
    fmt = writing_format(dtype)
    torch_dtype = torch.float32 if fmt else getattr(torch, dtype)
    natural = BITS[dtype] if fmt else torch.finfo(torch_dtype).bits
    if bits_per_weight is not None and not manifest_only and bits_per_weight != natural:
        raise StoreError(f"--bits-per-weight other than {dtype}'s {natural:g} needs --manifest-only")
    cfg = PRESETS[preset]
    if layers is not None:
        cfg = replace(cfg, n_layers=layers)
    bits = bits_per_weight if bits_per_weight is not None else natural
    units = unit_shapes(cfg)
    tok = byte_tokenizer()
    if cfg.vocab < tok.get_vocab_size():
        raise StoreError(f"preset vocab {cfg.vocab} is smaller than the synthetic tokenizer's")
    sizes: dict[str, int] = {}  # a quantized manifest-only store: the files' real sizes (every layer alike)
    with StoreWriter(out, overwrite=overwrite) as w:
        for n, (unit, shapes) in enumerate(units.items()):
            kind = "expert" if ".expert." in unit else unit.split(".")[0]
            if manifest_only and fmt and bits_per_weight is None:
                if kind not in sizes:
                    sizes[kind] = len(save(random_quantized(unit, cfg, fmt, 0, fill=False)))
                w.entries[unit] = FileEntry(path=unit_file(unit), bytes=sizes[kind])
            elif manifest_only:
                params = sum(torch.Size(s).numel() for s in shapes.values())
                w.entries[unit] = FileEntry(path=unit_file(unit), bytes=int(params * bits / 8))
            elif fmt:
                w.write_unit(unit, random_quantized(unit, cfg, fmt, seed * 100003 + n))
            else:
                w.write_unit(unit, random_unit(shapes, seed * 100003 + n, torch_dtype))
            progress(n + 1, len(units))
        w.add_file("tokenizer.json", tok.to_str().encode())
        w.finish(name=f"synthetic-{preset}", config=cfg, dtype=dtype, bits_per_weight=bits,
                 manifest_only=manifest_only, tokenizer="tokenizer.json", chat_template=chat_template,
                 bos_token_id=None, eos_token_ids=(2,), extra={"seed": seed, "preset": preset},
                 quant=fmt.manifest() if fmt else {})
    return out
