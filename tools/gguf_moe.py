"""Mixtures of experts in GGUF files as llama.cpp writes them: config keys, the router and shared expert of a layer,
and each expert cut out of the merged `ffn_{gate,up,down}_exps` tensors as a unit of its own."""

from types import SimpleNamespace

import torch
from gguf import MODEL_TENSOR, GGUFReader, Keys

from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.shapes import expert_shapes
from tools.gguf_names import tensor_name as name

MOE_ARCHS = ("qwen2moe", "qwen3moe")  # llama.cpp's names; Mixtral is its "llama" with experts
# llama.cpp's own choice where the file does not say (expert_weights_norm): qwen3moe and Mixtral renormalise
NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "mixtral": True}
EXPS = {"w_gate": MODEL_TENSOR.FFN_GATE_EXP, "w_up": MODEL_TENSOR.FFN_UP_EXP, "w_down": MODEL_TENSOR.FFN_DOWN_EXP}
SHARED = {"ws_gate": MODEL_TENSOR.FFN_GATE_SHEXP, "ws_up": MODEL_TENSOR.FFN_UP_SHEXP,
          "ws_down": MODEL_TENSOR.FFN_DOWN_SHEXP}


def family(reader: GGUFReader, arch: str) -> str:
    """The store's architecture: llama.cpp's, but "mixtral" for a llama with experts."""
    return "mixtral" if arch == "llama" and experts(reader, arch) else arch


def experts(reader: GGUFReader, arch: str) -> int:
    f = reader.fields.get(Keys.LLM.EXPERT_COUNT.format(arch=arch))
    return int(f.contents()) if f else 0


def moe_fields(reader: GGUFReader, arch: str, key) -> dict:
    """ModelConfig's mixture fields (key(k, default): a metadata value of this architecture)."""
    n = experts(reader, arch)
    if not n:
        return {}
    fam = family(reader, arch)
    return dict(n_experts=n, n_experts_used=int(key(Keys.LLM.EXPERT_USED_COUNT)),
                moe_intermediate=int(key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, 0) or key(Keys.LLM.FEED_FORWARD_LENGTH)),
                shared_intermediate=int(key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)),
                norm_topk_prob=bool(key(Keys.LLM.EXPERT_WEIGHTS_NORM, NORM_TOPK[fam])))


def dense_tensors(g, i: int) -> dict[str, torch.Tensor]:
    """Layer i's router (float) and shared expert (fused and quantized in a quantized store); g: GgufTensors."""
    unit = {"router.weight": g.get(name(MODEL_TENSOR.FFN_GATE_INP, i))}
    if not g.cfg.shared_intermediate:
        return unit
    unit["shared_gate.weight"] = g.get(name(MODEL_TENSOR.FFN_GATE_INP_SHEXP, i)).reshape(1, -1)
    parts = {p: name(t, i) for p, t in SHARED.items()}
    if g.fmt:
        gate_up = [(parts["ws_gate"], None), (parts["ws_up"], None)]
        return {**unit, **g.matrix("ws_gate_up", gate_up, g.fmt.matrix("ws_gate_up")),
                **g.matrix("ws_down", [(parts["ws_down"], None)], g.fmt.matrix("ws_down"))}
    return {**unit, **{f"{p}.weight": g.get(n) for p, n in parts.items()}}


def add_expert_slices(g, i: int) -> None:
    """Register each expert's rows of layer i's merged tensors as tensors of their own (GgufTensors reads them as
    any 2-D tensor: de-quantized, or int4 blocks kept exactly)."""
    for part, t in EXPS.items():
        merged = g.tensor(name(t, i))
        for e in range(g.cfg.n_experts):
            g.tensors[slice_name(i, part, e)] = SimpleNamespace(
                name=slice_name(i, part, e), data=merged.data[e], shape=merged.shape[:2],
                tensor_type=merged.tensor_type)


def slice_name(i: int, part: str, e: int) -> str:
    return f"{name(EXPS[part], i)}[{e}]"


def expert_tensors(g, i: int, e: int) -> dict[str, torch.Tensor]:
    """Expert e of layer i under the store's names (add_expert_slices first)."""
    parts = {p: slice_name(i, p, e) for p in EXPS}
    if g.fmt:
        gate_up = [(parts["w_gate"], None), (parts["w_up"], None)]
        return {**g.matrix("w_gate_up", gate_up, g.fmt.matrix("w_gate_up")),
                **g.matrix("w_down", [(parts["w_down"], None)], g.fmt.matrix("w_down"))}
    shapes = expert_shapes(g.cfg)
    out = {f"{p}.weight": g.get(n).contiguous() for p, n in parts.items()}
    bad = next((k for k, t in out.items() if tuple(t.shape) != shapes[k]), None)
    if bad:
        raise StoreError(f"{g.src}: layer {i}'s experts' {bad} has shape {tuple(out[bad].shape)}; "
                         f"expected {shapes[bad]}")
    return out
