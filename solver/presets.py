"""Model shape presets (real dims of public checkpoints) that need no files on disk."""

from __future__ import annotations

from solver.model_profile import ModelProfile

Q4K_BITS = 4.5  # llama.cpp Q4_K_M averages about 4.5 bits per weight

# name -> (architecture, H, I, L, nh, nkv, V, max_seq_len)
PRESETS: dict[str, tuple[str, int, int, int, int, int, int, int]] = {
    "llama3-8b": ("llama", 4096, 14336, 32, 32, 8, 128256, 8192),
    "llama3-70b": ("llama", 8192, 28672, 80, 64, 8, 128256, 8192),
    "qwen2.5-32b": ("qwen2", 5120, 27648, 64, 40, 8, 152064, 32768),
    "qwen2.5-72b": ("qwen2", 8192, 29568, 80, 64, 8, 152064, 32768),
}


def preset(name: str, bits_per_weight: float = Q4K_BITS) -> ModelProfile:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    arch, h, i, layers, nh, nkv, v, seq = PRESETS[name]
    return ModelProfile.from_dims(hidden=h, intermediate=i, n_layers=layers, n_heads=nh, n_kv_heads=nkv,
                                  vocab=v, max_seq_len=seq, bits_per_weight=bits_per_weight,
                                  architecture=arch)
