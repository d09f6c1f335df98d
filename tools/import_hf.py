"""Import a Hugging Face directory (config.json, safetensors shards) of a supported family into a store."""

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from nodes.engine.formats import Format, writing_format
from prima_rpc.spec.arch import ARCHS
from prima_rpc.spec.manifest import DTYPES, ModelConfig, StoreError, expert_unit
from prima_rpc.spec.shapes import layer_shapes, unit_shapes
from tools import hf_moe
from tools.hf_moe import moe_fields
from tools.hf_rope import context_length, rope, rotary_dim
from tools.store_writer import StoreWriter, quantize_unit

HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3",
         "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "mixtral"}
# Image-text checkpoints whose text model is one of those: its config (text_config) and its tensors' prefixes,
# transformers 5's and 4's, taken for a causal LM's ("model.", "lm_head.")
MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                 "language_model.lm_head.": "lm_head."}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF's hidden_act -> Arch.act
DEFAULT_ACT = {"gemma3": "gelu_pytorch_tanh"}  # what transformers assumes when config.json says nothing
# HF name inside model.layers.{i} -> store names (see import_gguf.LAYER_NAMES); a fused matrix (Phi-3) names its
# parts in row order. HF's q/k rows are already in rotate-half order, so unlike GGUF nothing is permuted.
ATTENTION = {
    "self_attn.q_proj.weight": ("wq.weight",), "self_attn.k_proj.weight": ("wk.weight",),
    "self_attn.v_proj.weight": ("wv.weight",), "self_attn.o_proj.weight": ("wo.weight",),
}
MATRICES = {**ATTENTION, "mlp.gate_proj.weight": ("w_gate.weight",), "mlp.up_proj.weight": ("w_up.weight",),
            "mlp.down_proj.weight": ("w_down.weight",)}  # a mixture's MLP: tools/hf_moe.py
FUSED_MATRICES = {
    "self_attn.qkv_proj.weight": ("wq.weight", "wk.weight", "wv.weight"), "self_attn.o_proj.weight": ("wo.weight",),
    "mlp.gate_up_proj.weight": ("w_gate.weight", "w_up.weight"), "mlp.down_proj.weight": ("w_down.weight",),
}
BIASES = {"self_attn.q_proj.bias": ("wq.bias",), "self_attn.k_proj.bias": ("wk.bias",),
          "self_attn.v_proj.bias": ("wv.bias",)}
NORMS = {"input_layernorm.weight": ("attn_norm.weight",), "post_attention_layernorm.weight": ("ffn_norm.weight",)}
POST_NORMS = {  # Gemma 3: post_attention_layernorm is the norm after attention, not the MLP's
    "input_layernorm.weight": ("attn_norm.weight",), "post_attention_layernorm.weight": ("post_attn_norm.weight",),
    "pre_feedforward_layernorm.weight": ("ffn_norm.weight",),
    "post_feedforward_layernorm.weight": ("post_ffn_norm.weight",),
}
QK_NORMS = {"self_attn.q_norm.weight": ("q_norm.weight",), "self_attn.k_norm.weight": ("k_norm.weight",)}
UNSUPPORTED = ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: invalid JSON ({exc})") from None


def architecture(hf: dict) -> str:
    archs = hf.get("architectures") or [hf.get("model_type")]
    arch = next((HF_CLASSES[a] for a in archs if a in HF_CLASSES), None)
    if arch is None:
        raise StoreError(f"unsupported architecture {archs!r}; supported: {sorted(HF_CLASSES)}")
    return arch


def local_attention(hf: dict, arch: str) -> dict:
    """Sliding-window layers: Gemma 3's (which they are, their window, RoPE base, and the attention's numbers), and
    those of Mistral, Phi-3 and Qwen2 models that set a window (all layers; Qwen2's from max_window_layers on)."""
    if arch != "gemma3":
        window = hf.get("sliding_window") if arch in ("mistral", "phi3", "mixtral") or hf.get("use_sliding_window") \
            else None
        first = int(hf.get("max_window_layers") or 0) if arch == "qwen2" else 0
        kinds = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(int(hf["num_hidden_layers"]))]
        local = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention") if window else ()
        return dict(sliding_window=int(window), local_layers=local) if local else {}
    n = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or ["full_attention" if (i + 1) % int(hf.get("sliding_window_pattern", 6)) == 0
                                      else "sliding_attention" for i in range(n)]
    local = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    if hf.get("attn_logit_softcapping") is not None:
        raise StoreError("attention logit soft-capping (Gemma 2) is not supported")
    return dict(sliding_window=int(hf["sliding_window"]) if local else None, local_layers=local,
                local_rope_theta=rope(hf, "sliding_attention")[0] if local else None,
                query_scale=float(hf.get("query_pre_attn_scalar", 256)),
                logit_softcap=hf.get("final_logit_softcapping"))


def read_config(hf: dict, tensors: dict[str, Path]) -> ModelConfig:
    """The model's shape from config.json; biases and tying are read off the tensor names."""
    arch = architecture(hf)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or DEFAULT_ACT.get(arch, "silu")
    if ACTIVATIONS.get(act) != ARCHS[arch].act:
        raise StoreError(f"activation {act!r} is not supported for {arch} (only {ARCHS[arch].act})")
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        theta, scaling = rope(hf)
        max_seq = context_length(int(hf.get("max_position_embeddings", 4096)), scaling)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        return ModelConfig(
            architecture=arch, hidden=hidden, intermediate=int(hf["intermediate_size"]),
            n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim, vocab=int(hf["vocab_size"]),
            max_seq_len=max_seq,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            rotary_dim=rotary_dim(hf, head_dim),
            qkv_bias=any(f"model.layers.0.{n}" in tensors for n in BIASES),
            tie_embeddings=bool(hf.get("tie_word_embeddings", "lm_head.weight" not in tensors)),
            **local_attention(hf, arch), **moe_fields(hf, arch),
        )
    except KeyError as exc:
        raise StoreError(f"config.json lacks {exc}") from None
    except (TypeError, ValueError) as exc:
        raise StoreError(f"config.json has a malformed value ({exc})") from None


def text_model(hf: dict) -> dict:
    """config.json of the text model: an image-text checkpoint's text_config (its vision tower is left out)."""
    text = next((MULTIMODAL[a] for a in hf.get("architectures") or [] if a in MULTIMODAL), None)
    if text is None:
        return hf
    outer = {k: hf[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "dtype") if k in hf}
    return {**outer, **hf.get("text_config", {}), "architectures": [text]}


def text_names(where: dict[str, Path]) -> dict[str, str]:
    """A causal LM's tensor name -> the checkpoint's, for an image-text checkpoint's text tensors."""
    return {causal + name[len(prefix):]: name for name in where
            for prefix, causal in TEXT_PREFIXES.items() if name.startswith(prefix)}


def tensor_files(src: Path) -> dict[str, Path]:
    """Which shard holds each tensor: from model.safetensors.index.json, else from every shard's header."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise StoreError(f"{index} has no weight_map")
        return {name: src / file for name, file in weight_map.items()}
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise StoreError(f"{src} has no *.safetensors files (pytorch .bin checkpoints are not supported)")
    where = {}
    for path in shards:
        with open_shard(path) as f:
            where.update(dict.fromkeys(f.keys(), path))
    return where


def open_shard(path: Path):
    try:
        return safe_open(path, framework="pt")
    except FileNotFoundError:
        raise StoreError(f"safetensors shard {path} is missing") from None
    except (SafetensorError, OSError) as exc:
        raise StoreError(f"{path}: truncated or corrupt safetensors file ({exc})") from None


class Shards:
    """Reads single tensors on demand, each shard opened (memory-mapped) once."""

    def __init__(self, where: dict[str, Path], stack: ExitStack, names: dict[str, str]):
        self.where, self.stack, self.handles, self.names = where, stack, {}, names  # names: text_names()

    def dtype(self, name: str) -> str:
        return self.handle(name).get_slice(self.names.get(name, name)).get_dtype()

    def handle(self, name: str):
        if name not in self.where:
            raise StoreError(f"checkpoint lacks tensor {name!r}")
        path = self.where[name]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(open_shard(path))
        if self.names.get(name, name) not in self.handles[path].keys():
            raise StoreError(f"{path.name} lacks tensor {self.names.get(name, name)!r} (the index lists it there)")
        return self.handles[path]

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        try:
            t = self.handle(name).get_tensor(self.names.get(name, name))
        except SafetensorError as exc:
            raise StoreError(f"{self.where[name]}: cannot read tensor {name!r} ({exc})") from None
        if tuple(t.shape) != shape:
            raise StoreError(f"tensor {name!r} has shape {tuple(t.shape)}; config.json implies {shape}")
        return t.to(dtype)


def ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def special_tokens(hf: dict, gen: dict, tok_cfg: dict, tok: Tokenizer, tok_json: dict) -> dict:
    """bos_token_id, eos_token_ids and add_bos for the manifest."""
    bos = hf.get("bos_token_id") if hf.get("bos_token_id") is not None else gen.get("bos_token_id")
    eos = ids(gen.get("eos_token_id")) or ids(hf.get("eos_token_id"))
    # The tokenizer's own EOS goes first: chat templates render it as {{ eos_token }}.
    spec = tok_cfg.get("eos_token")
    text = spec.get("content") if isinstance(spec, dict) else spec
    tok_eos = tok.token_to_id(text) if isinstance(text, str) else None
    eos = ([tok_eos] if tok_eos is not None else []) + eos
    add_bos = tok_cfg.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = bos is not None and adds_bos(tok_json, tok.id_to_token(int(bos)))
    return {"bos_token_id": None if bos is None else int(bos), "eos_token_ids": tuple(dict.fromkeys(eos)),
            "add_bos": add_bos}


def adds_bos(tok_json: dict, bos: str | None) -> bool:
    """Whether tokenizer.json's post-processor puts BOS in front (when tokenizer_config does not say)."""
    post = tok_json.get("post_processor") or {}
    for p in post.get("processors", [post]):
        if p.get("type") == "TemplateProcessing":
            return any(piece.get("SpecialToken", {}).get("id") == bos for piece in p.get("single", []))
    return False


# generation_config.json's names -> the manifest's sampling names (nodes/generation/sampling.py's DEFAULTS)
SAMPLING_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "repetition_penalty": "repeat_penalty"}


def generation_sampling(src: Path) -> dict:
    """The sampling the model's makers recommend (generation_config.json with do_sample set), else none."""
    try:
        cfg = json.loads((src / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict) or not cfg.get("do_sample"):
        return {}
    return {ours: cfg[theirs] for theirs, ours in SAMPLING_NAMES.items() if theirs in cfg}


def model_template(src: Path, tok_cfg: dict) -> str | None:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text()
    return template


def read_tokenizer(src: Path, hf: dict) -> tuple[bytes, dict, dict]:
    """tokenizer.json's bytes, tokenizer_config.json (or {}), and the manifest's special tokens."""
    if not (src / "tokenizer.json").is_file():
        raise StoreError(f"{src}: tokenizer.json is missing (only fast tokenizers are supported)")
    tok_bytes = (src / "tokenizer.json").read_bytes()
    try:
        tok = Tokenizer.from_str(tok_bytes.decode())
    except Exception as exc:  # tokenizers raises plain Exception
        raise StoreError(f"{src / 'tokenizer.json'}: not a valid tokenizer ({str(exc)[:120]})") from None
    tok_cfg = read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
    gen = read_json(src / "generation_config.json") if (src / "generation_config.json").is_file() else {}
    try:
        special = special_tokens(hf, gen, tok_cfg, tok, json.loads(tok_bytes))
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{src}: malformed special token ids ({exc})") from None
    return tok_bytes, tok_cfg, special


def layer_names(cfg: ModelConfig, where: dict[str, Path]) -> dict[str, tuple[str, ...]]:
    """HF names inside model.layers.{i} -> their store names, once every tensor the store needs is known to be in
    the checkpoint and none it cannot hold is."""
    prefix = [f"model.layers.{i}." for i in range(cfg.n_layers)]
    bad = next((p + n for p in prefix for n in UNSUPPORTED if p + n in where), None)
    if bad:
        raise StoreError(f"tensor {bad!r}: output/MLP biases are not supported")
    fused = "model.layers.0.self_attn.qkv_proj.weight" in where  # Phi-3
    matrices = {**ATTENTION, **hf_moe.DENSE[cfg.architecture]} if cfg.moe else FUSED_MATRICES if fused else MATRICES
    names = {**matrices, **(POST_NORMS if cfg.arch.post_norms else NORMS)}
    names.update({**(BIASES if cfg.qkv_bias else {}), **(QK_NORMS if cfg.arch.qk_norm else {})})
    needed = [p + n for p in prefix for n in names] + ["model.embed_tokens.weight", "model.norm.weight"]
    needed += ([] if cfg.tie_embeddings else ["lm_head.weight"]) + (hf_moe.needed(cfg, where) if cfg.moe else [])
    missing = next((n for n in needed if n not in where), None)
    if missing:
        raise StoreError(f"checkpoint lacks tensor {missing!r}")
    return names


def store_dtype(dtype: str | None, hf: dict, shards: Shards) -> str:
    """The store's dtype: the one asked for, else the checkpoint's (config.json's, else its embedding's)."""
    if dtype is None:
        dtype = hf.get("dtype") or hf.get("torch_dtype") or SAFETENSORS_DTYPES.get(
            shards.dtype("model.embed_tokens.weight"), "")
    if dtype not in DTYPES:
        raise StoreError(f"weight dtype {dtype!r} is not supported; pass dtype= one of {DTYPES}")
    return dtype


def read_layer(shards: Shards, i: int, cfg: ModelConfig, names: dict[str, tuple[str, ...]],
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer i's tensors under the store's names: fused matrices split by rows, norms as (offset + w)."""
    shapes, unit = layer_shapes(cfg), {}
    for hf_name, parts in names.items():
        rows = [shapes[p][0] for p in parts]
        t = shards.get(f"model.layers.{i}.{hf_name}", (sum(rows), *shapes[parts[0]][1:]), dtype)
        unit.update(zip(parts, t.split(rows) if len(parts) > 1 else (t,), strict=True))
    return {n: norm_values(n, t, cfg) for n, t in unit.items()}


def norm_values(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A store holds the weight its norm multiplies by: Gemma's checkpoints hold it minus one."""
    return t + cfg.arch.norm_offset if name.endswith("norm.weight") and cfg.arch.norm_offset else t


def write_units(w: StoreWriter, shards: Shards, cfg: ModelConfig, names: dict[str, tuple[str, ...]],
                fmt: Format | None, dtype: torch.dtype, progress: Callable[[int, int], None]) -> None:
    """The embed, layer and head units, tensors read as `dtype` (and quantized in `fmt`, None: float)."""
    shapes = unit_shapes(cfg)

    def write(unit: str, tensors: dict[str, torch.Tensor]) -> None:
        w.write_unit(unit, *(quantize_unit(tensors, fmt) if fmt else (tensors,)))

    write("embed", {"embed.weight": shards.get("model.embed_tokens.weight", shapes["embed"]["embed.weight"], dtype)})
    for i in range(cfg.n_layers):
        write(f"layer.{i}", {n: t.contiguous() for n, t in read_layer(shards, i, cfg, names, dtype).items()})
        for e in range(cfg.n_experts):
            write(expert_unit(i, e), hf_moe.read_expert(shards, cfg, i, e, dtype))
        progress(i + 1, cfg.n_layers)
    norm = shards.get("model.norm.weight", shapes["head"]["norm.weight"], dtype)
    head = {"norm.weight": norm_values("norm.weight", norm, cfg)}
    if not cfg.tie_embeddings:
        head["output.weight"] = shards.get("lm_head.weight", shapes["head"]["output.weight"], dtype)
    write("head", head)


def import_hf(src: Path, out: Path, *, dtype: str | None = None, name: str | None = None, overwrite: bool = False,
              progress: Callable[[int, int], None] = lambda done, total: None, chat_template: str | None = None
              ) -> Path:
    """name: the store's (None: the directory's); chat_template: the store's (None: the model's own)."""
    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise StoreError(f"{src}: config.json is missing (not a Hugging Face model directory)")
    hf = text_model(read_json(src / "config.json"))
    architecture(hf)  # fail on an unsupported model before opening any shard
    tok_bytes, tok_cfg, special = read_tokenizer(src, hf)
    where = tensor_files(src)
    renamed = text_names(where)
    where.update({name: where[real] for name, real in renamed.items()})
    cfg = read_config(hf, where)
    names = layer_names(cfg, where)
    with ExitStack() as stack:
        shards = Shards(where, stack, renamed)
        dtype = store_dtype(dtype, hf, shards)
        fmt = writing_format(dtype)
        with StoreWriter(out, overwrite=overwrite) as w:
            write_units(w, shards, cfg, names, fmt, torch.float32 if fmt else getattr(torch, dtype), progress)
            w.add_file("tokenizer.json", tok_bytes)
            w.finish(name=name or out.resolve().name, config=cfg, dtype=dtype, tokenizer="tokenizer.json",
                     chat_template=chat_template or model_template(src, tok_cfg),
                     quant=fmt.manifest() if fmt else {}, sampling=generation_sampling(src), **special)
    return out
