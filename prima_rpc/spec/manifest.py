"""The layer store's manifest: model shape, rope, tokenizer facts and the per-unit file list."""

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prima_rpc.spec.arch import ARCHS, Arch

FORMAT = "prima-store/1"
MANIFEST = "manifest.json"
ARCHITECTURES = tuple(ARCHS)
MOE_FIELDS = ("n_experts", "n_experts_used", "moe_intermediate", "shared_intermediate", "norm_topk_prob")
ROPE_SCALINGS = ("linear", "llama3", "factors", "yarn", "longrope", "dynamic")  # nodes/engine/rope.py computes each
DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")  # int8/int4: nodes/engine/quant.py


class StoreError(Exception):
    """A layer store that is missing, malformed or does not match its manifest."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the store directory
    bytes: int
    sha256: str = ""  # empty in manifest-only stores
    format: str = ""  # the unit's weight format (a DTYPES name); empty in stores written before it was recorded


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # {"type": T, ...}: T one of nodes/engine/rope.py's SCALINGS ("linear", "llama3", "yarn", "longrope",
    # "dynamic", or "factors": a GGUF's rope_freqs, each frequency divided by its factor), with its numbers as
    # transformers names them ("factor", "original_max_position_embeddings", "short_factor", ...)
    rope_scaling: dict | None = None
    rotary_dim: int | None = None  # RoPE turns the first rotary_dim of each head's dimensions (None: all of them)
    qkv_bias: bool = False
    tie_embeddings: bool = False
    # Sliding-window attention: layers in `local_layers` see only the last `sliding_window` positions (Gemma 3's
    # local layers, every layer of a Mistral with a window) and, where local_rope_theta is set, use that RoPE base
    # unscaled (Gemma 3); queries scaled by query_scale ** -0.5 (None: head_dim); logits soft-capped at logit_softcap.
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    query_scale: float | None = None
    logit_softcap: float | None = None
    # Mixtures of experts (Arch.moe): each layer's MLP is n_experts experts of width moe_intermediate, of which a
    # softmax router picks n_experts_used a token (their weights renormalised to sum 1 when norm_topk_prob),
    # beside a shared expert of width shared_intermediate scaled by a sigmoid gate (Qwen2-MoE; 0: none).
    n_experts: int = 0
    n_experts_used: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    norm_topk_prob: bool = False

    @property
    def arch(self) -> Arch:
        return ARCHS[self.architecture]

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise StoreError(f"unsupported architecture {self.architecture!r}; supported: {ARCHITECTURES}")
        for name in ("hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab"):
            if getattr(self, name) <= 0:
                raise StoreError(f"model dimension {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise StoreError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.local_layers and not (self.sliding_window and self.sliding_window > 0
                                      and all(0 <= i < self.n_layers for i in self.local_layers)):
            raise StoreError(f"local layers {self.local_layers} need a positive sliding_window (got "
                             f"{self.sliding_window}) and indices below {self.n_layers}")
        if self.rope_scaling is not None and self.rope_scaling.get("type") not in ROPE_SCALINGS:
            raise StoreError(f"rope scaling {self.rope_scaling.get('type')!r} is not supported; supported: "
                             f"{', '.join(ROPE_SCALINGS)}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise StoreError(f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")


@dataclass(frozen=True)
class Manifest:
    name: str
    config: ModelConfig
    dtype: str  # weight dtype of the safetensors files
    bits_per_weight: float  # bytes on disk per weight * 8 (below 16 for quantized-size what-ifs)
    embed: FileEntry
    layers: tuple[FileEntry, ...]
    head: FileEntry
    experts: tuple[tuple[FileEntry, ...], ...] = ()  # mixtures of experts: [layer][expert] units (expert_unit)
    tokenizer: str | None = None  # tokenizer.json (Hugging Face tokenizers format)
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos: bool = False
    manifest_only: bool = False
    quant: dict = field(default_factory=dict)  # quantized stores: how matrices are packed (nodes.engine.formats.Format)
    # the model's own sampling settings (nodes/generation/sampling.py's DEFAULTS names): temperature, top_k, ...
    sampling: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        cfg = asdict(self.config)
        moe = {k: cfg.pop(k) for k in MOE_FIELDS}
        dims = {k: cfg.pop(k) for k in ("hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads",
                                         "head_dim", "vocab", "max_seq_len")}
        return {
            "format": FORMAT,
            "name": self.name,
            "architecture": cfg.pop("architecture"),
            "dims": dims,
            "norm_eps": cfg.pop("norm_eps"),
            "rope": {"theta": cfg.pop("rope_theta"), "scaling": cfg.pop("rope_scaling"),
                     **({"dim": dim} if (dim := cfg.pop("rotary_dim")) else {})},  # partial rotary only
            "qkv_bias": cfg.pop("qkv_bias"),
            "tie_embeddings": cfg.pop("tie_embeddings"),
            # what is left: the Gemma-style attention fields, written only when some are set (old stores unchanged)
            **({"attention": cfg} if any(v not in (None, ()) for v in cfg.values()) else {}),
            **({"moe": moe} if moe["n_experts"] else {}),  # dense stores unchanged
            "dtype": self.dtype,
            "bits_per_weight": self.bits_per_weight,
            "manifest_only": self.manifest_only,
            "tokenizer": self.tokenizer,
            "chat_template": self.chat_template,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos": self.add_bos,
            "files": {
                "embed": asdict(self.embed),
                "layers": [asdict(f) for f in self.layers],
                "head": asdict(self.head),
                **({"experts": [[asdict(f) for f in layer] for layer in self.experts]} if self.experts else {}),
            },
            **({"quant": self.quant} if self.quant else {}),
            **({"sampling": self.sampling} if self.sampling else {}),  # stores without settings unchanged
            **({"extra": self.extra} if self.extra else {}),
        }

    @staticmethod
    def from_json(data: dict) -> "Manifest":
        try:
            if data.get("format") != FORMAT:
                raise StoreError(f"not a {FORMAT} manifest (format={data.get('format')!r})")
            dims, rope, files = data["dims"], data["rope"], data["files"]
            config = ModelConfig(
                architecture=data["architecture"], **dims, norm_eps=float(data["norm_eps"]),
                rope_theta=float(rope["theta"]), rope_scaling=rope.get("scaling"), rotary_dim=rope.get("dim"),
                qkv_bias=bool(data["qkv_bias"]), tie_embeddings=bool(data["tie_embeddings"]),
                **attention_fields(data.get("attention", {})), **data.get("moe", {}),
            )
            layers = tuple(FileEntry(**f) for f in files["layers"])
            if len(layers) != config.n_layers:
                raise StoreError(f"manifest lists {len(layers)} layer files for {config.n_layers} layers")
            experts = tuple(tuple(FileEntry(**f) for f in layer) for layer in files.get("experts", ()))
            if [len(e) for e in experts] != ([config.n_experts] * config.n_layers if config.moe else []):
                raise StoreError(f"manifest lists expert files {[len(e) for e in experts]} for {config.n_layers} "
                                 f"layers of {config.n_experts} experts")
            if data["dtype"] not in DTYPES:
                raise StoreError(f"unsupported weight dtype {data['dtype']!r}; supported: {DTYPES}")
            return Manifest(
                name=data["name"], config=config, dtype=data["dtype"],
                bits_per_weight=float(data["bits_per_weight"]),
                embed=FileEntry(**files["embed"]), layers=layers, head=FileEntry(**files["head"]), experts=experts,
                tokenizer=data.get("tokenizer"), chat_template=data.get("chat_template"),
                bos_token_id=data.get("bos_token_id"), eos_token_ids=tuple(data.get("eos_token_ids", ())),
                add_bos=bool(data.get("add_bos", False)), manifest_only=bool(data.get("manifest_only", False)),
                quant=data.get("quant", {}), sampling=dict(data.get("sampling", {})), extra=data.get("extra", {}),
            )
        except (KeyError, TypeError) as exc:
            raise StoreError(f"malformed manifest: missing or wrong field {exc}") from None

    def units(self) -> dict[str, FileEntry]:
        """Every weight unit by name: 'embed', 'layer.0' .. 'layer.{L-1}', 'head', and each expert of a mixture
        of experts (expert_unit)."""
        named = {"embed": self.embed, "head": self.head}
        named.update({f"layer.{i}": f for i, f in enumerate(self.layers)})
        named.update({expert_unit(i, e): f for i, layer in enumerate(self.experts) for e, f in enumerate(layer)})
        return named


def expert_unit(layer: int, expert: int) -> str:
    """The unit name of one expert of a layer's mixture: its own file, read, held and fetched alone."""
    return f"layer.{layer}.expert.{expert}"


def attention_fields(attention: dict) -> dict:
    """ModelConfig's Gemma-style attention fields from the manifest's optional "attention" object."""
    out = dict(attention)
    if "local_layers" in out:
        out["local_layers"] = tuple(int(i) for i in out["local_layers"])
    return out


def read_manifest(store_dir: Path) -> tuple[Manifest, str]:
    """The manifest of a store and its fingerprint (sha256 of the manifest file)."""
    path = Path(store_dir) / MANIFEST
    if not path.is_file():
        raise StoreError(f"{store_dir} is not a layer store: {MANIFEST} is missing")
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise StoreError(f"{path}: invalid JSON ({exc})") from None
    return Manifest.from_json(data), hashlib.sha256(raw).hexdigest()
