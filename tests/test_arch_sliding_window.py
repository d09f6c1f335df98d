"""Sliding-window layers keep only their window of keys and values (a ring of window + ROW_ATTENTION positions in
place of the request's capacity): Gemma 3's local layers, a Mistral's and a Phi-3's window, over a prompt far
longer than the window, give transformers' greedy tokens and logits, alone, in prefill chunks, after rejected
drafts, and (Gemma 3, Phi-3) from a GGUF written by llama.cpp's converter."""

import pytest
import torch

from nodes.engine.model import KVCache
from nodes.engine.row_attention import ROW_ATTENTION
from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.manifest import read_manifest
from tests.arch_models import ATOL, greedy, reference, write_model
from tests.llama_convert import convert
from tools.import_gguf import import_gguf
from tools.import_hf import import_hf

WINDOW = 4
PROMPT = torch.randint(3, 49000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
STEPS = 8
# Gemma 3's window of 4: tests/arch_models.py; Phi-3's as Phi-3-mini sets one (2047)
FAMILIES = {"gemma3": {}, "mistral": dict(sliding_window=WINDOW), "phi3": dict(sliding_window=WINDOW)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def windowed(request, smol_store, tmp_path_factory):
    """(store, transformers' greedy tokens, its logits [len(PROMPT) + STEPS - 1, V], the HF directory)."""
    out = tmp_path_factory.mktemp(request.param)
    hf = write_model(request.param, smol_store / "tokenizer.json", out / "hf", **FAMILIES[request.param])
    return (import_hf(hf, out / "store"), *reference(hf, PROMPT, STEPS), hf)


def test_tokens_and_logits_equal_transformers_past_the_window(windowed):
    store, ids, logits, _ = windowed
    got, rows = greedy(ReferenceModel(store), PROMPT, STEPS)
    assert got == ids
    assert (rows - logits).abs().max() < ATOL


@pytest.mark.slow
def test_from_a_gguf_too(windowed, tmp_path):
    """llama.cpp's converter writes Gemma 3's and Phi-3's windows (a Mistral's llama-architecture GGUF has none)."""
    store, ids, logits, hf = windowed
    if read_manifest(store)[0].config.architecture == "mistral":
        # a windowless Mistral's GGUF: tests/test_architectures.py::test_gguf_import_equals_transformers
        pytest.skip("llama.cpp's converter writes no window for a Mistral")
    gguf_store = import_gguf(convert(hf, tmp_path / "w.gguf"), tmp_path / "store")
    got, want = (read_manifest(s)[0].config for s in (gguf_store, store))
    assert (got.sliding_window, got.local_layers) == (want.sliding_window, want.local_layers)
    got_ids, rows = greedy(ReferenceModel(gguf_store), PROMPT, STEPS)
    assert got_ids == ids and (rows - logits).abs().max() < ATOL


def test_a_windowed_layer_holds_its_window_not_the_capacity(windowed):
    cfg = read_manifest(windowed[0])[0].config
    capacity, slots = len(PROMPT) + STEPS, WINDOW + ROW_ATTENTION
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # k and v, float32
    cache = KVCache(list(range(cfg.n_layers)), cfg, capacity, torch.float32)
    local = len(cfg.local_layers)
    assert local == (5 if cfg.architecture == "gemma3" else cfg.n_layers)  # every sixth Gemma 3 layer is global
    assert cache.nbytes() == per_position * (local * slots + (cfg.n_layers - local) * capacity)
    assert cache.nbytes() < per_position * cfg.n_layers * capacity
    # the prefix another request could copy: whole while the ring holds it, none once it lost the prompt's start
    assert (cache.reusable_prefix(slots), cache.reusable_prefix(slots + 1)) == (slots, 0)
    short = KVCache(list(range(cfg.n_layers)), cfg, slots, torch.float32)  # a short request keeps no ring
    assert short.nbytes() == per_position * cfg.n_layers * slots and short.reusable_prefix(slots) == slots


def test_prefill_chunks_and_rejected_drafts_keep_the_window(windowed):
    """The prompt in chunks (one longer than the ring, one a verify frame's size), then a verify frame of 17 rows
    whose last 15 drafts are rejected: the next step must still see the window those drafts' writes wrapped."""
    store, ids, logits, _ = windowed
    model, n = ReferenceModel(store), len(PROMPT)
    cache = model.new_cache(n + STEPS + ROW_ATTENTION)
    rows = [model.step_all(PROMPT[:30], 0, cache), model.step_all(PROMPT[30:], 30, cache)]
    drafts = ids[:2] + [7] * (ROW_ATTENTION - 2)  # the pending token and one right draft, then wrong ones
    rows.append(model.step_all(drafts, n, cache)[:2])
    rows.append(model.step_all(ids[2:STEPS - 1], n + 2, cache))
    assert (torch.cat(rows) - logits).abs().max() < ATOL


def test_a_wrapped_window_ring_keeps_no_prefix_and_a_whole_one_is_reused(windowed):
    """The prefix cache copies positions [0, n): a windowed layer's ring that wrapped no longer has them."""
    from nodes.engine.prefix_cache import Prefix
    from nodes.engine.shard import Shard
    from nodes.engine.store import LayerStore
    from prima_rpc.spec.windows import Windows

    store = LayerStore(windowed[0])
    n_layers = store.config.n_layers
    shard = Shard(store, Windows(((0, n_layers),), n_layers, True), torch.float32)

    def prefill(rid, ids, pos, prefix=Prefix()):
        cache = shard.cache_for(rid, pos, len(PROMPT) + STEPS, len(ids) - pos, prefix)
        return shard.logits(shard.compute(shard.embed(ids[pos:]), cache, pos, 0)[0])

    prefill("long", PROMPT, 0, Prefix(save_key="long", save_len=32, prefill=True))  # 40 rows wrap a ring of 21
    assert shard.prefixes.positions() == 0
    short = PROMPT[:12]
    cold = prefill("cold", short, 0)
    prefill("first", short[:10], 0, Prefix(save_key="p", save_len=8, prefill=True))
    assert shard.prefixes.positions() == 8
    warm = prefill("warm", short, 8, Prefix("p", 8, prefill=True))  # 4 rows: matmuls of another shape
    assert warm.argmax() == cold.argmax() and (warm - cold).abs().max() < 1e-4  # last row's logits
