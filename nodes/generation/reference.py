"""The single-process reference: the whole model from the layer store in one process."""

from collections.abc import Iterator
from pathlib import Path

import torch

from nodes.engine.dtype_choice import compute_dtype
from nodes.engine.formats import weight_format
from nodes.engine.kv_dtype import FLOAT, KVDtype
from nodes.engine.loading import read_layer
from nodes.engine.model import KVCache, OutputHead, Rope, head_numerics, run_layers
from nodes.engine.store import LayerStore
from nodes.generation.speculate import Speculator
from nodes.generation.state import GenerateParams, Generation, TokenOut
from nodes.generation.text import TextCodec


class ReferenceModel:
    def __init__(self, store_dir: Path, dtype: torch.dtype | None = None, kv_dtype: KVDtype = FLOAT):
        """dtype: of the activations (None: float32 for float stores, the machine's choice for quantized ones);
        kv_dtype: how its KV caches store rows."""
        self.store = LayerStore(store_dir)
        self.cfg = self.store.config
        m = self.store.manifest
        self.dtype = dtype = dtype or getattr(torch, compute_dtype(m.dtype))
        self.kv_dtype = kv_dtype
        fmt = weight_format(m)
        self.head = OutputHead.from_units(self.store.load("embed"), self.store.load("head"), dtype,
                                          self.cfg.tie_embeddings, fmt, **head_numerics(self.cfg))
        self.layers = {i: read_layer(self.store, i, self.cfg, dtype, fmt) for i in range(self.cfg.n_layers)}
        self.rope = Rope(self.cfg, self.cfg.max_seq_len, dtype)
        self.codec = TextCodec(m, self.store.tokenizer_path())
        self.finish_reason: str | None = None  # of the last generation run to its end ("stop", "length", ...)

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(list(self.layers), self.cfg, capacity, self.dtype, self.kv_dtype)

    @torch.inference_mode()
    def hidden(self, ids: list[int], pos: int, cache: KVCache, start: int = 0, stop: int | None = None,
               x: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after layers [start, stop) for tokens at positions [pos, pos+T)."""
        if x is None:
            x = self.head.embed_tokens(torch.tensor(ids))
        stop = self.cfg.n_layers if stop is None else stop
        return run_layers(x, self.layers, start, stop, cache, pos, self.cfg, self.rope)

    @torch.inference_mode()
    def step(self, ids: list[int], pos: int, cache: KVCache) -> torch.Tensor:
        """Float32 logits [V] of the last of `ids`."""
        h = self.hidden(ids, pos, cache)
        return self.head.logits(h[-1:], self.cfg.norm_eps)[0]

    @torch.inference_mode()
    def step_all(self, ids: list[int], pos: int, cache: KVCache) -> torch.Tensor:
        """Float32 logits [T, V] of every one of `ids` (a verification forward). Each row is projected alone,
        exactly as step() projects its one row."""
        h = self.hidden(ids, pos, cache)
        return torch.cat([self.head.logits(h[i:i + 1], self.cfg.norm_eps) for i in range(len(ids))])

    def generate_ids(self, prompt_ids: list[int], params: GenerateParams,
                     spec: Speculator | None = None) -> Iterator[TokenOut]:
        """spec: pass one to read its drafted / accepted counts afterwards."""
        gen = Generation(prompt_ids, params, self.codec, self.store.manifest.eos_token_ids, self.cfg.max_seq_len,
                         spec, self.cfg.vocab)
        cache = self.new_cache(gen.capacity)
        while not gen.done:
            ids, pos = gen.pending()
            if draft := gen.draft():
                yield from gen.accept_draft(self.step_all(ids + draft, pos, cache), draft)
            else:
                yield gen.accept(self.step(ids, pos, cache))
        self.finish_reason = gen.finish_reason

    def generate(self, prompt: str, params: GenerateParams, raw: bool = False,
                 spec: Speculator | None = None) -> Iterator[TokenOut]:
        return self.generate_ids(self.codec.prompt_ids(prompt, raw=raw), params, spec)
