"""Model profile: per-layer bytes, FLOPs and KV-cache size of a dense decoder, from a store manifest."""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
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
        for key in ("embed_bytes", "head_bytes"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{key} must be an int >= 0, got {v!r}")

    # --- derived quantities (per decode token) ---
    @property
    def layer_params(self) -> int:
        h, nh, nkv, hd = self.hidden, self.n_heads, self.n_kv_heads, self.head_dim
        attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h  # wq, wk, wv, wo
        return attn + 3 * h * self.intermediate  # w1, w2, w3

    @property
    def serial_fraction(self) -> float:
        """The share of a layer's compute that a streaming node cannot overlap with its reads in a turn:
        the attention stage of the round's first layer (its reads wait for it to free the buffer) and
        the down projection of the last (computed after its read); nodes.model.STAGES."""
        h, nh, nkv, hd = self.hidden, self.n_heads, self.n_kv_heads, self.head_dim
        attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
        return (attn + h * self.intermediate) / self.layer_params

    @property
    def layer_flops(self) -> int:
        return 2 * self.layer_params  # one multiply-add per weight per token

    @property
    def layer_bytes_max(self) -> int:
        # The solver treats layers as equal; the largest one keeps memory rows safe.
        return max(self.layer_bytes)

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
    def from_manifest(cls, manifest: dict) -> ModelProfile:
        if not isinstance(manifest, dict):
            raise ValueError(f"manifest must be a dict, got {type(manifest).__name__}")
        try:
            dims, files = manifest["dims"], manifest["files"]
            return cls(
                architecture=manifest["architecture"],
                hidden=dims["hidden"], intermediate=dims["intermediate"], n_layers=dims["n_layers"],
                n_heads=dims["n_heads"], n_kv_heads=dims["n_kv_heads"], head_dim=dims["head_dim"],
                vocab=dims["vocab"], max_seq_len=dims["max_seq_len"],
                dtype=manifest["dtype"], bits_per_weight=float(manifest["bits_per_weight"]),
                tie_embeddings=bool(manifest["tie_embeddings"]),
                layer_bytes=tuple(f["bytes"] for f in files["layers"]),
                embed_bytes=files["embed"]["bytes"], head_bytes=files["head"]["bytes"],
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"manifest is missing or mistypes {e!s}") from e

    @classmethod
    def from_dims(cls, *, hidden: int, intermediate: int, n_layers: int, n_heads: int, n_kv_heads: int,
                  vocab: int, head_dim: int | None = None, max_seq_len: int = 8192,
                  bits_per_weight: float = 4.5, architecture: str = "llama", dtype: str = "bfloat16",
                  tie_embeddings: bool = False) -> ModelProfile:
        """Shape-only profile: file sizes are params * bits_per_weight / 8, as a store would write them."""
        hd = head_dim or hidden // n_heads
        tmp = cls(architecture, hidden, intermediate, n_layers, n_heads, n_kv_heads, hd, vocab, max_seq_len,
                  dtype, bits_per_weight, tie_embeddings, (1,) * n_layers, 0, 0)
        norms = 2 * hidden * 4  # two fp32 RMSNorm vectors per layer
        layer = int(tmp.layer_params * bits_per_weight / 8) + norms
        embed = int(vocab * hidden * bits_per_weight / 8)
        head = hidden * 4 + (0 if tie_embeddings else embed)
        return cls(architecture, hidden, intermediate, n_layers, n_heads, n_kv_heads, hd, vocab, max_seq_len,
                   dtype, bits_per_weight, tie_embeddings, (layer,) * n_layers, embed, head)

    def to_manifest(self) -> dict:
        """A minimal manifest with the keys `from_manifest` reads (paths are placeholders)."""
        return {
            "architecture": self.architecture,
            "dims": {"hidden": self.hidden, "intermediate": self.intermediate, "n_layers": self.n_layers,
                     "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim,
                     "vocab": self.vocab, "max_seq_len": self.max_seq_len},
            "tie_embeddings": self.tie_embeddings, "dtype": self.dtype, "bits_per_weight": self.bits_per_weight,
            "files": {"embed": {"path": "embed.safetensors", "bytes": self.embed_bytes},
                      "layers": [{"path": f"layer_{i:03d}.safetensors", "bytes": b}
                                 for i, b in enumerate(self.layer_bytes)],
                      "head": {"path": "head.safetensors", "bytes": self.head_bytes}},
        }
