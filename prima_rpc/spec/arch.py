"""How each supported decoder family differs from Llama, as data: the maths and the importers read it here."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """One family's departures from a Llama decoder (per-model numbers live in ModelConfig)."""

    name: str
    act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # RMSNorms after attention and after the MLP too, before each residual add (Gemma 3)
    norm_offset: float = 0.0  # checkpoint norms hold w - offset; the store holds w (Gemma's (1 + w)), added on import
    embed_scale: bool = False  # embeddings times sqrt(hidden) (Gemma)
    gguf_permuted_qk: bool = False  # llama.cpp permuted q/k rows for its interleaved RoPE (undone on import)
    moe: bool = False  # every layer's MLP is a mixture of experts (nodes/engine/moe.py; ModelConfig's numbers)


ARCHS = {a.name: a for a in (
    Arch("llama", gguf_permuted_qk=True),
    Arch("mistral", gguf_permuted_qk=True),
    Arch("qwen2"),
    Arch("qwen3", qk_norm=True),
    Arch("phi3"),  # fused qkv and gate_up in the checkpoint: split on import
    Arch("qwen2moe", moe=True),  # with a shared expert beside the routed ones
    Arch("qwen3moe", qk_norm=True, moe=True),
    Arch("mixtral", gguf_permuted_qk=True, moe=True),
    Arch("gemma3", act="gelu_tanh", qk_norm=True, post_norms=True, norm_offset=1.0, embed_scale=True),
)}
