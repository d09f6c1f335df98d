"""A GGUF file's model shape and numerics (ModelConfig) from its metadata, under the `gguf` package's key names."""

from pathlib import Path

from gguf import MODEL_TENSOR, TENSOR_NAMES, GGUFReader, Keys

from prima_rpc.spec.manifest import ModelConfig, StoreError
from tools.gguf_moe import MOE_ARCHS, family, moe_fields

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", *MOE_ARCHS)  # llama.cpp's general.architecture names
UNSUPPORTED_TENSORS = {  # tensors whose maths the engine lacks: refused rather than silently ignored
    TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_LONG]: "long-context rope factors (Phi-3 longrope)",
    TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_SHORT]: "long-context rope factors (Phi-3 longrope)",
}
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


def rope_scaling(reader: GGUFReader, src: Path, arch: str, head_dim: int) -> dict | None:
    """Linear scaling (Gemma 3 4B and up) from the metadata; llama3 scaling as llama.cpp's converter stores it: one
    factor per frequency (rope_freqs.weight)."""
    kind = field(reader, Keys.Rope.SCALING_TYPE.format(arch=arch), "none")
    if kind == "linear":
        return {"type": "linear", "factor": float(field(reader, Keys.Rope.SCALING_FACTOR.format(arch=arch)))}
    if kind != "none":
        raise StoreError(f"{src}: rope scaling {kind!r} is not supported (only linear and llama3's rope_freqs)")
    freqs = tensor(reader, f"{TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS]}.weight")
    if freqs is None:
        return None
    factors = [float(v) for v in freqs.data.reshape(-1)]
    if len(factors) != head_dim // 2:
        raise StoreError(f"{src}: rope_freqs.weight has {len(factors)} factors for head_dim {head_dim}")
    return {"type": "factors", "factors": factors}


def local_attention(reader: GGUFReader, arch: str, n_layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 3's sliding-window layers and attention numbers, with llama.cpp's defaults where the file is silent."""
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


def read_config(reader: GGUFReader, src: Path) -> ModelConfig:
    arch = field(reader, Keys.General.ARCHITECTURE)
    if arch not in ARCHS:
        raise StoreError(f"{src}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}")
    bad = next((what for name, what in UNSUPPORTED_TENSORS.items() if tensor(reader, f"{name}.weight")), None)
    if bad:
        raise StoreError(f"{src}: {bad} are not supported")

    def key(k: str, default=None):
        return field(reader, k.format(arch=arch), default)

    hidden, heads = int(key(Keys.LLM.EMBEDDING_LENGTH)), int(key(Keys.Attention.HEAD_COUNT))
    embed = tensor(reader, f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight")
    if embed is None:
        raise StoreError(f"{src}: GGUF file lacks tensor 'token_embd.weight'")
    n_layers, head_dim = int(key(Keys.LLM.BLOCK_COUNT)), int(key(Keys.Attention.KEY_LENGTH, hidden // heads))
    return ModelConfig(
        architecture=family(reader, arch), hidden=hidden, intermediate=int(key(Keys.LLM.FEED_FORWARD_LENGTH)),
        n_layers=n_layers, n_heads=heads, n_kv_heads=int(key(Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim, vocab=int(embed.shape[1]), max_seq_len=int(key(Keys.LLM.CONTEXT_LENGTH, 4096)),
        norm_eps=float(key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        rope_theta=float(key(Keys.Rope.FREQ_BASE, 10000.0)), rope_scaling=rope_scaling(reader, src, arch, head_dim),
        qkv_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        tie_embeddings=tensor(reader, f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight") is None,
        **local_attention(reader, arch, n_layers, hidden, heads, head_dim), **moe_fields(reader, arch, key),
    )
