"""Model profile: per-layer bytes, FLOPs and KV-cache size of a dense decoder, from a parsed store manifest."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from prima_rpc.spec.manifest import ARCHITECTURES, DTYPES, MOE_FIELDS, FileEntry, Manifest, ModelConfig, StoreError
from prima_rpc.spec.shapes import expert_params, layer_flops, layer_params, matrix_params, matrix_shapes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 2, "int4": 2}  # KV elements: quantized stores
# compute (and cache) in bfloat16
ACT_ELEM_BYTES = 4  # activations travel the ring as fp32


@dataclass(frozen=True)
class ModelProfile:
    architecture: str
    hidden: int  # H
    intermediate: int  # I
    n_layers: int  # L
    n_heads: int  # nh
    n_kv_heads: int  # nkv
    head_dim: int  # hd
    vocab: int  # V
    max_seq_len: int  # S
    dtype: str
    bits_per_weight: float
    tie_embeddings: bool
    layer_bytes: tuple[int, ...]  # [L] on-disk bytes of each decoder layer file
    embed_bytes: int  # embedding file
    head_bytes: int  # final norm + output projection file
    qkv_bias: bool = False
    moe: tuple = ()  # a mixture of experts: ModelConfig's MOE_FIELDS values (layer_bytes then include its experts)
    expert_bytes: int = 0  # a mixture: one expert's file (the largest), 0: dense

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for key in ("hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab",
                    "max_seq_len"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"dims.{key} must be an int >= 1, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if not 0 < self.bits_per_weight <= 64:
            raise ValueError(f"bits_per_weight must be in (0, 64], got {self.bits_per_weight!r}")
        if len(self.layer_bytes) != self.n_layers:
            raise ValueError(f"files.layers has {len(self.layer_bytes)} entries, dims.n_layers is {self.n_layers}")
        for i, b in enumerate(self.layer_bytes):
            if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
                raise ValueError(f"files.layers[{i}].bytes must be an int > 0, got {b!r}")
        for key in ("embed_bytes", "head_bytes", "expert_bytes"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{key} must be an int >= 0, got {v!r}")
        if self.moe and not 0 < self.config.n_experts * self.expert_bytes < min(self.layer_bytes):
            raise ValueError(f"a mixture's {self.config.n_experts} experts of {self.expert_bytes} bytes must be "
                             f"part of each layer's bytes (smallest {min(self.layer_bytes)})")

    # --- derived quantities (per decode token) ---
    @cached_property
    def config(self) -> ModelConfig:
        """The shape as the nodes hold it (prima_rpc.spec.shapes computes from it)."""
        return ModelConfig(self.architecture, self.hidden, self.intermediate, self.n_layers, self.n_heads,
                           self.n_kv_heads, self.head_dim, self.vocab, self.max_seq_len, qkv_bias=self.qkv_bias,
                           tie_embeddings=self.tie_embeddings, **dict(zip(MOE_FIELDS, self.moe, strict=False)))

    @cached_property
    def layer_params(self) -> int:
        return layer_params(self.config)

    @cached_property
    def serial_fraction(self) -> float:
        """The share of a layer's compute that a streaming node cannot overlap with its reads in a turn:
        the attention stage of the round's first layer (its reads wait for it to free the buffer) and
        the down projection of the last (computed after its read); nodes.engine.model.STAGES."""
        m = {unit: a * b for unit, (a, b) in matrix_shapes(self.config).items()}
        return (m["wqkv"] + m["wo"] + m.get("w_down", 0)) / matrix_params(self.config)

    @cached_property
    def layer_flops(self) -> int:
        return layer_flops(self.config)

    @property
    def layer_bytes_max(self) -> int:
        # The solver treats layers as equal; the largest one keeps memory rows safe.
        return max(self.layer_bytes)

    @property
    def dense_bytes(self) -> int:
        """A layer's bytes but its experts (all of them for a dense model): what a mixture's node always keeps."""
        return self.layer_bytes_max - self.config.n_experts * self.expert_bytes

    @property
    def routed_bytes(self) -> int:
        """The experts' bytes one token reads in a layer (top-k of them; 0: dense)."""
        return self.config.n_experts_used * self.expert_bytes

    @property
    def active_bytes(self) -> int:
        """The weight bytes one token reads in a layer: all of a dense one, a mixture's dense part and top-k."""
        return self.dense_bytes + self.routed_bytes

    @property
    def routed_share(self) -> float:
        """top-k / E: the share of a layer's experts a token uses (0: dense)."""
        return self.config.n_experts_used / self.config.n_experts if self.moe else 0.0

    @property
    def kv_bytes_per_token_layer(self) -> int:
        # K and V in the store's dtype: a float32 store runs in float32 (prima-node's default), 16-bit and
        # quantized ones are planned with 16-bit caches
        return 2 * self.n_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def output_flops(self) -> int:
        return 2 * self.hidden * self.vocab

    @property
    def output_weight_bytes(self) -> int:
        # Tied models multiply by the embedding matrix; the head file then holds only the norm.
        return self.embed_bytes if self.tie_embeddings else self.head_bytes

    @property
    def head_extra_bytes(self) -> int:
        """Bytes the head keeps resident besides its window: embedding + final norm/output."""
        return self.embed_bytes + self.head_bytes

    @property
    def activation_bytes(self) -> int:
        return self.hidden * ACT_ELEM_BYTES  # one token's hidden state on the wire

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes

    # --- constructors ---
    @classmethod
    def from_manifest(cls, manifest: Manifest) -> ModelProfile:
        c = manifest.config
        return cls(c.architecture, c.hidden, c.intermediate, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
                   c.vocab, c.max_seq_len, manifest.dtype, manifest.bits_per_weight, c.tie_embeddings,
                   tuple(f.bytes + sum(e.bytes for e in (manifest.experts[i] if c.moe else ()))
                         for i, f in enumerate(manifest.layers)),  # a mixture's layer: its dense part and experts
                   manifest.embed.bytes, manifest.head.bytes, c.qkv_bias, moe_values(c),
                   max((e.bytes for layer in manifest.experts for e in layer), default=0) if c.moe else 0)

    @classmethod
    def from_json(cls, data: dict) -> ModelProfile:
        """From a manifest's JSON (parsed by spec/manifest.py, the one parser); ValueError when it is malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"manifest must be a dict, got {type(data).__name__}")
        try:
            return cls.from_manifest(Manifest.from_json(data))
        except StoreError as e:
            raise ValueError(str(e)) from None

    @classmethod
    def from_config(cls, cfg: ModelConfig, *, bits_per_weight: float = 4.5, dtype: str = "bfloat16") -> ModelProfile:
        """Shape-only profile: matrices at bits_per_weight / 8 bytes a weight, norms and biases in float32,
        as a manifest-only store would list them."""
        matrices = matrix_params(cfg)
        one = int(expert_params(cfg) * bits_per_weight / 8)
        layer = int(matrices * bits_per_weight / 8) + cfg.n_experts * one + (layer_params(cfg) - matrices) * 4
        embed = int(cfg.vocab * cfg.hidden * bits_per_weight / 8)
        head = cfg.hidden * 4 + (0 if cfg.tie_embeddings else embed)
        return cls(cfg.architecture, cfg.hidden, cfg.intermediate, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                   cfg.head_dim, cfg.vocab, cfg.max_seq_len, dtype, bits_per_weight, cfg.tie_embeddings,
                   (layer,) * cfg.n_layers, embed, head, cfg.qkv_bias, moe_values(cfg), one)

    @classmethod
    def from_dims(cls, *, hidden: int, intermediate: int, n_layers: int, n_heads: int, n_kv_heads: int,
                  vocab: int, head_dim: int | None = None, max_seq_len: int = 8192,
                  bits_per_weight: float = 4.5, architecture: str = "llama", dtype: str = "bfloat16",
                  tie_embeddings: bool = False) -> ModelProfile:
        """Shape-only profile of these dims (from_config)."""
        cfg = ModelConfig(architecture, hidden, intermediate, n_layers, n_heads, n_kv_heads,
                          head_dim or hidden // n_heads, vocab, max_seq_len, tie_embeddings=tie_embeddings)
        return cls.from_config(cfg, bits_per_weight=bits_per_weight, dtype=dtype)

    def to_manifest(self) -> dict:
        """A manifest-only store's manifest JSON of this profile (paths are placeholders; a mixture's layers list
        their dense parts and each expert its own file, as a store does)."""
        def entry(path: str, size: int) -> FileEntry:
            return FileEntry(path=path, bytes=size)

        n, one = self.config.n_experts, self.expert_bytes
        return Manifest(
            name=f"profile-{self.architecture}", config=self.config, dtype=self.dtype,
            bits_per_weight=self.bits_per_weight, embed=entry("embed.safetensors", self.embed_bytes),
            layers=tuple(entry(f"layer_{i:03d}.safetensors", b - n * one) for i, b in enumerate(self.layer_bytes)),
            head=entry("head.safetensors", self.head_bytes), manifest_only=True,
            experts=tuple(tuple(entry(f"layer_{i:03d}_expert_{e:03d}.safetensors", one) for e in range(n))
                          for i in range(self.n_layers)) if self.moe else (),
        ).to_json()


def moe_values(cfg: ModelConfig) -> tuple:
    """ModelProfile.moe of a shape (empty: dense)."""
    return tuple(getattr(cfg, k) for k in MOE_FIELDS) if cfg.moe else ()
