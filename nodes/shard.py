"""The model part a node holds for one assignment: its windows' layers, KV caches, and (head) the head.

Everything here is synchronous torch work, called from the node's single compute thread.
"""

from collections.abc import Callable

import torch

from nodes.config import StoreError
from nodes.model import Head, KVCache, Layer, Rope, run_layers
from nodes.routing import Windows
from nodes.store import LayerStore


class Shard:
    def __init__(self, store: LayerStore, windows: Windows, dtype: torch.dtype,
                 progress: Callable[[int, int, str], None] = lambda done, total, unit: None):
        self.store, self.windows, self.dtype = store, windows, dtype
        self.cfg = store.config
        units = [f"layer.{i}" for i in windows.layers()] + (["embed", "head"] if windows.head else [])
        total = sum(store.entry(u).bytes for u in units)
        done = 0
        self.layers: dict[int, Layer] = {}
        loaded: dict[str, dict] = {}
        for unit in units:
            tensors = store.load(unit)
            if unit.startswith("layer."):
                self.layers[int(unit.split(".")[1])] = Layer.from_unit(tensors, dtype)
            else:
                loaded[unit] = tensors
            done += store.entry(unit).bytes
            progress(done, total, unit)
        self.head = (Head.from_units(loaded["embed"], loaded["head"], dtype, self.cfg.tie_embeddings)
                     if windows.head else None)
        self.rope = Rope(self.cfg, self.cfg.max_seq_len, dtype)
        self.caches: dict[str, KVCache] = {}

    def resident_bytes(self) -> int:
        weights = sum(layer.nbytes() for layer in self.layers.values())
        if self.head is not None:
            weights += sum(t.numel() * t.element_size() for t in {id(t): t for t in
                           (self.head.embed, self.head.norm, self.head.output)}.values())
        return weights + sum(c.nbytes() for c in self.caches.values())

    def cache_for(self, request_id: str, start_pos: int, capacity: int, tokens: int) -> KVCache:
        """The request's cache, made on its first frame; ValueError for frames that do not fit it."""
        cache = self.caches.get(request_id)
        if cache is None:
            if start_pos != 0:
                raise ValueError(f"unknown request id {request_id!r} (no KV cache here; frames must start at 0)")
            if not (tokens <= capacity <= self.cfg.max_seq_len):
                raise ValueError(f"capacity {capacity} must be in [{tokens}, {self.cfg.max_seq_len}]")
            cache = self.caches[request_id] = KVCache(self.windows.layers(), self.cfg, capacity, self.dtype)
        if start_pos + tokens > cache.capacity:
            raise ValueError(f"positions [{start_pos}, {start_pos + tokens}) exceed the request's "
                             f"KV capacity {cache.capacity}")
        return cache

    def release(self, request_id: str) -> bool:
        return self.caches.pop(request_id, None) is not None

    @torch.inference_mode()
    def compute(self, x: torch.Tensor, cache: KVCache, start_pos: int, next_layer: int) -> tuple[torch.Tensor, int]:
        """Run every consecutive window from next_layer; returns the new hidden state and next layer."""
        x = x.to(self.dtype)
        for start, stop in self.windows.run_from(next_layer):
            x = run_layers(x, self.layers, start, stop, cache, start_pos, self.cfg, self.rope)
            next_layer = stop
        return x, next_layer

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.head.embed_tokens(torch.tensor(ids))

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [V] of the last position of h [T, H]."""
        return self.head.logits(h[-1:].to(self.dtype), self.cfg.norm_eps)[0]


def check_assignment(store: LayerStore | None, windows: Windows, model_id: str) -> None:
    if windows.relay:
        return
    if store is None:
        raise StoreError("this node was started without --model, so it can only be a relay")
    if model_id and model_id != store.model_id:
        raise StoreError(f"model mismatch: the ring runs {model_id[:12]}, this node has {store.model_id[:12]}")
    if windows.n_layers != store.config.n_layers:
        raise StoreError(f"the ring's model has {windows.n_layers} layers, this node's has {store.config.n_layers}")
