"""A mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): a softmax router picks each row's top-k experts, the
rows are grouped by expert so that each chosen expert runs once a step, and rows no expert was chosen for cost
nothing. The block is one more kind of MLP of a Layer (nodes/engine/model.py)."""

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nodes.engine.quant import Int4, Int8, linear

Weight = torch.Tensor | Int4 | Int8  # as nodes.engine.model's: a matrix [N, K] used through linear()


@dataclass
class Expert:
    """One gated MLP: an expert, or Qwen2-MoE's shared expert."""

    w_gate_up: Weight  # [2 I, H]
    w_down: Weight  # [H, I]

    def __call__(self, x: torch.Tensor, act: Callable) -> torch.Tensor:
        gate, up = linear(x, self.w_gate_up).chunk(2, dim=-1)
        return linear(act(gate) * up, self.w_down)


# experts(ids) -> {expert: Expert, or a Future of one still being read} for the experts a step chose (offload)
ExpertSource = Callable[[list[int]], dict[int, Expert | Future]]


@dataclass
class MoE:
    """A layer's mixture: its router and shared expert (the dense part), and its experts (all resident, or a
    source that reads them when the router has chosen them)."""

    router: torch.Tensor  # [E, H] float32: routing decided in full precision whatever the compute dtype
    experts: dict[int, Expert] | ExpertSource  # expert -> its weights
    top_k: int
    norm_topk: bool  # renormalise the chosen experts' weights to sum 1
    shared: Expert | None = None  # Qwen2-MoE: added to every row, scaled by sigmoid(shared_gate . x)
    shared_gate: torch.Tensor | None = None  # [1, H]

    def weights(self) -> list[Weight]:
        """Every weight it holds in memory (resident experts included)."""
        parts = [self.router] + ([self.shared.w_gate_up, self.shared.w_down, self.shared_gate] if self.shared else [])
        held = self.experts.values() if isinstance(self.experts, dict) else ()
        return parts + [w for e in held for w in (e.w_gate_up, e.w_down)]


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, experts [T, k]) of each row of x [T, H], as transformers routes: softmax over all
    experts in float32, the top k, renormalised if asked."""
    probs = F.softmax(F.linear(x.float(), router), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if norm_topk else weights), chosen


def moe_mlp(x: torch.Tensor, moe: MoE, act: Callable) -> torch.Tensor:
    """The mixture's output for normed rows x [T, H]: sum over each row's chosen experts of weight * expert(row)
    (+ the gated shared expert); each chosen expert runs once, over the rows that chose it. Experts in memory run
    first, the shared expert next, those still being read as they arrive; outputs are summed in expert order
    whatever the order they ran in, so that offload gives the very same numbers."""
    weights, chosen = route(x, moe.router, moe.top_k, moe.norm_topk)
    used = chosen.unique().tolist()  # sorted: experts run (and offloaded ones are read) in one order
    experts = moe.experts if isinstance(moe.experts, dict) else moe.experts(used)
    ready = [e for e in used if not isinstance(experts[e], Future)]
    ys = {e: run_expert(x, experts[e], e, chosen, weights, act) for e in ready}
    shared = None  # beside the reads still in flight
    if moe.shared is not None:
        shared = torch.sigmoid(linear(x, moe.shared_gate)) * moe.shared(x, act)
    for e in used:
        if e not in ys:
            ys[e] = run_expert(x, experts[e].result(), e, chosen, weights, act)  # waits for its read (or raises)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in used:
        out.index_add_(0, *ys[e])
    out = out.to(x.dtype)
    return out if shared is None else out + shared


def run_expert(x: torch.Tensor, fn: Expert, e: int, chosen: torch.Tensor, weights: torch.Tensor,
               act: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, their weighted outputs [n, H] float32) of expert e over the rows that chose it."""
    rows, slot = (chosen == e).nonzero(as_tuple=True)
    return rows, fn(x[rows], act).float() * weights[rows, slot, None]
