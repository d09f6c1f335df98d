"""Model shape presets (real dims of public checkpoints) that need no files on disk."""

from __future__ import annotations

from prima_rpc.spec.shapes import PRESETS
from solver.model_profile import ModelProfile

Q4K_BITS = 4.5  # llama.cpp Q4_K_M averages about 4.5 bits per weight


def preset(name: str, bits_per_weight: float = Q4K_BITS) -> ModelProfile:
    """The profile of a store of this shape written at `bits_per_weight` (prima_rpc.spec.shapes.PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return ModelProfile.from_config(PRESETS[name], bits_per_weight=bits_per_weight)
