"""A GGUF file's model shape and numerics (ModelConfig) from its metadata, under the `gguf` package's key names."""

from pathlib import Path

from gguf import MODEL_TENSOR, GGUFReader, Keys

from prima_rpc.spec.arch import ARCHS as ARCH_OF
from prima_rpc.spec.manifest import ModelConfig, StoreError
from tools.gguf_moe import MOE_ARCHS, family, moe_fields
from tools.gguf_names import tensor_name
from tools.hf_rope import context_length

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", *MOE_ARCHS)  # llama.cpp's general.architecture names
GEMMA3_PATTERN = 6  # llama.cpp's Gemma 3: every sixth layer global, the others sliding-window
GEMMA3_LOCAL_THETA = 10000.0  # and their RoPE base, unless the file says


def field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise StoreError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def tensor(reader: GGUFReader, name: str):
    return next((t for t in reader.tensors if t.name == name), None)


def rope_scaling(reader: GGUFReader, src: Path, arch: str, rot_dim: int) -> dict | None:
    """The store's rope scaling (nodes/engine/rope.py's SCALINGS) from llama.cpp's metadata and tensors: linear
    (Gemma 3 4B and up) and YaRN (Qwen) from the metadata, llama3 scaling as its converter stores it (one factor
    per frequency: rope_freqs.weight), LongRoPE (Phi-3.5, Phi-4-mini) as its long and short factor tensors."""
    def key(k: str, default=None):
        return field(reader, k.format(arch=arch), default)

    kind = key(Keys.Rope.SCALING_TYPE, "none")
    long, short = (tensor(reader, tensor_name(t))
                   for t in (MODEL_TENSOR.ROPE_FACTORS_LONG, MODEL_TENSOR.ROPE_FACTORS_SHORT))
    if long is not None or kind == "longrope":
        if long is None or short is None:
            raise StoreError(f"{src}: LongRoPE needs both rope_factors_long and rope_factors_short tensors")
        return {"type": "longrope", "short_factor": factors(src, short, rot_dim),
                "long_factor": factors(src, long, rot_dim),
                "original_max_position_embeddings": int(key(Keys.Rope.SCALING_ORIG_CTX_LEN)),
                "attention_factor": float(key(Keys.Rope.SCALING_ATTN_FACTOR, 1.0))}
    if kind == "linear":
        return {"type": "linear", "factor": float(key(Keys.Rope.SCALING_FACTOR))}
    if kind == "yarn":
        optional = {name: reader.fields[k.format(arch=arch)].contents() for name, k in (
            ("beta_fast", Keys.Rope.SCALING_YARN_BETA_FAST), ("beta_slow", Keys.Rope.SCALING_YARN_BETA_SLOW),
            ("attention_factor", Keys.Rope.SCALING_YARN_ATTN_FACTOR)) if k.format(arch=arch) in reader.fields}
        return {"type": "yarn", "factor": float(key(Keys.Rope.SCALING_FACTOR)),
                "original_max_position_embeddings": int(key(Keys.Rope.SCALING_ORIG_CTX_LEN)), **optional}
    if kind != "none":
        raise StoreError(f"{src}: rope scaling {kind!r} is not supported (only linear, yarn, longrope and llama3's "
                         f"rope_freqs)")
    freqs = tensor(reader, tensor_name(MODEL_TENSOR.ROPE_FREQS))
    return None if freqs is None else {"type": "factors", "factors": factors(src, freqs, rot_dim)}


def factors(src: Path, t, rot_dim: int) -> list[float]:
    """A per-frequency factor tensor's values: one for each of the rot_dim / 2 frequencies."""
    values = [float(v) for v in t.data.reshape(-1)]
    if len(values) != rot_dim // 2:
        raise StoreError(f"{src}: {t.name} has {len(values)} factors for {rot_dim} rotary dimensions")
    return values


def local_attention(reader: GGUFReader, arch: str, n_layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 3's sliding-window layers and attention numbers, with llama.cpp's defaults where the file is silent;
    a Phi-3 with a window (its converter writes 0 for none) has it in every layer, as llama.cpp reads it."""
    if arch == "phi3" and int(field(reader, Keys.Attention.SLIDING_WINDOW.format(arch=arch), 0)):
        window = int(field(reader, Keys.Attention.SLIDING_WINDOW.format(arch=arch)))
        return dict(sliding_window=window, local_layers=tuple(range(n_layers)))
    if arch != "gemma3":
        return {}
    window = reader.fields.get(Keys.Attention.SLIDING_WINDOW.format(arch=arch))
    pattern = int(field(reader, Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch), GEMMA3_PATTERN))
    local = tuple(i for i in range(n_layers) if (i + 1) % pattern) if window else ()
    softcap = reader.fields.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=arch))
    return dict(
        sliding_window=int(window.contents()) if window else None, local_layers=local,
        local_rope_theta=float(field(reader, Keys.Rope.FREQ_BASE_SWA.format(arch=arch), GEMMA3_LOCAL_THETA))
        if local else None,
        # llama.cpp scales queries by head_dim, but by hidden / heads in the 62-layer 27B (query_pre_attn_scalar)
        query_scale=float(hidden // heads if n_layers == 62 else head_dim),
        logit_softcap=float(softcap.contents()) if softcap else None,
    )


def has_qkv_bias(reader: GGUFReader, n_layers: int) -> bool:
    """Whether a layer holds a q bias (Qwen2's q, k, v biases)."""
    names = {t.name for t in reader.tensors}
    return any(tensor_name(MODEL_TENSOR.ATTN_Q, i, "bias") in names for i in range(n_layers))


def read_config(reader: GGUFReader, src: Path) -> ModelConfig:
    arch = field(reader, Keys.General.ARCHITECTURE)
    if arch not in ARCHS:
        raise StoreError(f"{src}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}")

    def key(k: str, default=None):
        return field(reader, k.format(arch=arch), default)

    hidden, heads = int(key(Keys.LLM.EMBEDDING_LENGTH)), int(key(Keys.Attention.HEAD_COUNT))
    embed = tensor(reader, tensor_name(MODEL_TENSOR.TOKEN_EMBD))
    if embed is None:
        raise StoreError(f"{src}: GGUF file lacks tensor {tensor_name(MODEL_TENSOR.TOKEN_EMBD)!r}")
    n_layers, head_dim = int(key(Keys.LLM.BLOCK_COUNT)), int(key(Keys.Attention.KEY_LENGTH, hidden // heads))
    rot_dim = int(key(Keys.Rope.DIMENSION_COUNT, head_dim))
    if rot_dim != head_dim and ARCH_OF[family(reader, arch)].gguf_permuted_qk:
        raise StoreError(f"{src}: partial rotary ({rot_dim} of {head_dim}) with llama.cpp's permuted q/k rows")
    scaling = rope_scaling(reader, src, arch, rot_dim)
    return ModelConfig(
        architecture=family(reader, arch), hidden=hidden, intermediate=int(key(Keys.LLM.FEED_FORWARD_LENGTH)),
        n_layers=n_layers, n_heads=heads, n_kv_heads=int(key(Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim, vocab=int(embed.shape[1]),
        max_seq_len=context_length(int(key(Keys.LLM.CONTEXT_LENGTH, 4096)), scaling),
        norm_eps=float(key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        rope_theta=float(key(Keys.Rope.FREQ_BASE, 10000.0)), rope_scaling=scaling,
        rotary_dim=None if rot_dim == head_dim else rot_dim,
        qkv_bias=has_qkv_bias(reader, n_layers),
        tie_embeddings=tensor(reader, tensor_name(MODEL_TENSOR.OUTPUT)) is None,
        **local_attention(reader, arch, n_layers, hidden, heads, head_dim), **moe_fields(reader, arch, key),
    )
