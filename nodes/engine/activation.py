"""A gated MLP's activation, act(gate) * up, computed one way for a float32 row on every path (the two C calls, a
window's one, the torch stages, a streamed layer): ops.c's silu_mul, whose exp is its own, so a request's tokens do
not depend on which path its rows took in a batch (torch's F.silu uses Sleef's expf, which ops.c cannot match)."""

from functools import partial

import torch
import torch.nn.functional as F

from nodes.engine.kernels import ops

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


def gated(gu: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of gu [..., 2 I] (gate_up's product: gate, then up) -> [..., I]: silu on float32 through
    ops.c where it builds; other dtypes, gelu_tanh (Gemma) and machines without ops.c through torch."""
    if act == "silu" and ops.fits(gu):
        return ops.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up
