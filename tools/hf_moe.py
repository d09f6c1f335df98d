"""Mixtures of experts in Hugging Face checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral): their config keys, the
names of their routers, shared experts and experts, and each expert read as a unit of its own."""

import torch

from prima_rpc.spec.manifest import ModelConfig, StoreError
from prima_rpc.spec.shapes import expert_shapes

# HF name inside model.layers.{i} -> the layer unit's name (router and shared expert: the dense part)
QWEN_DENSE = {"mlp.gate.weight": ("router.weight",)}
QWEN_SHARED = {"mlp.shared_expert.gate_proj.weight": ("ws_gate.weight",),
               "mlp.shared_expert.up_proj.weight": ("ws_up.weight",),
               "mlp.shared_expert.down_proj.weight": ("ws_down.weight",),
               "mlp.shared_expert_gate.weight": ("shared_gate.weight",)}
DENSE = {"qwen3moe": QWEN_DENSE, "qwen2moe": {**QWEN_DENSE, **QWEN_SHARED},
         "mixtral": {"block_sparse_moe.gate.weight": ("router.weight",)}}
# HF name inside an expert, model.layers.{i}.{prefix}.{e}. -> the expert unit's name
QWEN_EXPERT = {"gate_proj.weight": "w_gate.weight", "up_proj.weight": "w_up.weight",
               "down_proj.weight": "w_down.weight"}
EXPERTS = {"qwen3moe": ("mlp.experts", QWEN_EXPERT), "qwen2moe": ("mlp.experts", QWEN_EXPERT),
           "mixtral": ("block_sparse_moe.experts", {"w1.weight": "w_gate.weight", "w3.weight": "w_up.weight",
                                                    "w2.weight": "w_down.weight"})}
# transformers' own checkpoints of these families renormalise the top-k weights where this says
NORM_TOPK = {"qwen3moe": False, "qwen2moe": False, "mixtral": True}  # the configs' defaults (Mixtral: always)


def moe_fields(hf: dict, arch: str) -> dict:
    """ModelConfig's mixture fields from config.json (none for a dense family)."""
    if arch not in EXPERTS:
        return {}
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise StoreError("mixtures with dense layers among the sparse ones (mlp_only_layers, decoder_sparse_step "
                         f"{hf.get('decoder_sparse_step')}) are not supported")
    n = hf.get("num_experts") or hf.get("num_local_experts")
    width = hf["intermediate_size"] if arch == "mixtral" else hf["moe_intermediate_size"]
    return dict(n_experts=int(n or 0), n_experts_used=int(hf["num_experts_per_tok"]), moe_intermediate=int(width),
                shared_intermediate=int(hf.get("shared_expert_intermediate_size") or 0) if arch == "qwen2moe" else 0,
                norm_topk_prob=True if arch == "mixtral" else bool(hf.get("norm_topk_prob", NORM_TOPK[arch])))


def expert_names(cfg: ModelConfig, i: int, e: int) -> dict[str, str]:
    """Checkpoint name -> expert unit name of expert e of layer i."""
    prefix, names = EXPERTS[cfg.architecture]
    return {f"model.layers.{i}.{prefix}.{e}.{hf}": store for hf, store in names.items()}


def needed(cfg: ModelConfig, where: dict) -> list[str]:
    """Every expert tensor the store needs (a transformers-5 checkpoint's fused experts are named so)."""
    names = [n for i in range(cfg.n_layers) for e in range(cfg.n_experts) for n in expert_names(cfg, i, e)]
    fused = next((n for n in where if n.endswith(("experts.gate_up_proj", "experts.down_proj"))), None)
    if fused:
        raise StoreError(f"tensor {fused!r}: fused expert tensors are not supported; save the checkpoint with "
                         "one tensor per expert")
    return names


def read_expert(shards, cfg: ModelConfig, i: int, e: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Expert e of layer i under the store's names (shards: import_hf.Shards)."""
    shapes = expert_shapes(cfg)
    return {store: shards.get(hf, shapes[store], dtype).contiguous() for hf, store in expert_names(cfg, i, e).items()}
