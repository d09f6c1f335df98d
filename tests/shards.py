"""In-process shards in ring order, stepped beside the single-process reference: what the offload and quantized
shard tests share."""

from pathlib import Path

import torch

from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.windows import Step, Windows


def ring_step(shards: list[Shard], caches: list, ids: list[int], pos: int) -> torch.Tensor:
    """One step through in-process shards in ring order (shards[0] is the head): logits of the last id."""
    x, next_layer, n = shards[0].embed(ids), 0, shards[0].cfg.n_layers
    while next_layer < n:
        i = next(i for i, s in enumerate(shards) if s.windows.step(next_layer) is Step.COMPUTE)
        x, next_layer = shards[i].compute(x, caches[i], pos, next_layer)
    return shards[0].logits(x)


def check_against_reference(store_dir: Path, ranges: list, budget: int, depth: int, steps: int,
                            prompt: str = "The quick brown fox", buffer: int = 0) -> list[Shard]:
    ref = ReferenceModel(store_dir)
    n = ref.cfg.n_layers
    shards = [Shard(LayerStore(store_dir), Windows(tuple(r), n, i == 0), torch.float32, budget=budget, depth=depth,
                    buffer=buffer) for i, r in enumerate(ranges)]
    try:
        ids = ref.codec.prompt_ids(prompt)
        capacity = len(ids) + steps
        ref_cache = ref.new_cache(capacity)
        caches = [s.cache_for("r", 0, capacity, len(ids)) for s in shards]
        pos = 0
        for _ in range(steps):
            expected = ref.step(ids, pos, ref_cache)
            got = ring_step(shards, caches, ids, pos)
            assert torch.equal(got, expected)  # bit for bit: same weights, same alignment, same math
            pos, ids = pos + len(ids), [int(expected.argmax())]
    finally:
        for s in shards:
            s.close()
    return shards
