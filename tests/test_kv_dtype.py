"""Quantized KV caches (nodes/engine/kv_dtype.py): rows stored as q8_0 / q4_0 read back within their blocks' step,
take the bytes a position says, and give a request the same bits alone, in a batch and in a verify frame."""

import json

import pytest
import torch

from nodes.engine.fused import kv_bytes
from nodes.engine.kv_dtype import FLOAT, INT4, INT8, KVDtype, kv_dtype, stored_as
from nodes.engine.model import KVCache
from nodes.engine.prefix_cache import PrefixCache
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from prima_rpc.spec.windows import Windows
from tests.ctl import assert_one_line_error, ctl_here


@pytest.mark.parametrize("dtype", [INT8, INT4])
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 48: not a multiple of the block, one scale a row
def test_rows_read_back_within_a_step_of_their_block(dtype, head_dim):
    x = torch.randn(2, 3, 7, head_dim) * torch.logspace(-2, 1, 7)[:, None]  # positions of very different sizes
    stored = dtype.pack(x, torch.float32)
    assert stored.dtype == torch.uint8 and stored.shape[-1] == dtype.row_bytes(head_dim, torch.float32)
    back = dtype.unpack(stored, head_dim, torch.float32)
    block = 32 if head_dim % 32 == 0 else head_dim
    amax = x.reshape(*x.shape[:-1], -1, block).abs().amax(-1, keepdim=True)
    # int8: half a step (round to nearest); int4: a whole one, as q4_0 maps the largest magnitude to -8 and clamps
    # the other sign's at +7
    bound = amax / 254 if dtype is INT8 else amax / 8
    err = (back - x).reshape(*x.shape[:-1], -1, block).abs()
    assert (err <= bound + amax * 1e-3).all()  # + the float16 scale's rounding
    assert stored_as(stored, head_dim) == dtype


def test_a_rows_bytes_depend_on_that_row_alone():
    x = torch.randn(2, 4, 9, 64)
    for dtype in (INT8, INT4):
        together = dtype.pack(x, torch.float32)
        alone = torch.cat([dtype.pack(x[:, :, i:i + 1], torch.float32) for i in range(9)], dim=2)
        assert torch.equal(together, alone)


def test_zero_rows_and_float_rows():
    zeros = torch.zeros(1, 1, 2, 64)
    for dtype in (INT8, INT4):
        assert torch.equal(dtype.unpack(dtype.pack(zeros, torch.float32), 64, torch.float32), zeros)
    x = torch.randn(2, 1, 3, 64)
    assert torch.equal(FLOAT.unpack(FLOAT.pack(x, torch.bfloat16), 64, torch.bfloat16), x.to(torch.bfloat16))
    assert stored_as(x, 64) == FLOAT


def test_bytes_per_token_as_llama_cpp_counts_them(tiny_store):
    # q8_0: 32 int8 + a float16 scale = 34 bytes a block; q4_0: 16 + 2 = 18
    assert INT8.row_bytes(128, torch.float32) == 4 * 34 and INT4.row_bytes(128, torch.float32) == 4 * 18
    assert FLOAT.row_bytes(128, torch.bfloat16) == 256 and FLOAT.row_bytes(128, torch.float32) == 512
    assert INT8.bytes_per_token(8, 128, torch.float32, layers=32) == 2 * 8 * 136 * 32
    cfg = LayerStore(tiny_store).config
    cache = KVCache(list(range(cfg.n_layers)), cfg, 100, torch.float32, INT8)
    assert cache.nbytes() == kv_bytes(cfg, torch.float32, cfg.n_layers, 100, INT8)
    assert cache.nbytes() < 0.3 * kv_bytes(cfg, torch.float32, cfg.n_layers, 100)


def test_an_unknown_kv_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="int8"):
        kv_dtype("int3")
    assert kv_dtype("int4") == KVDtype("int4")


@pytest.mark.parametrize("kv", [INT8, INT4])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_a_verify_frame_and_a_batch_give_each_row_its_steps_bits(kv, compute, tiny_store):
    """As tests/test_batch_invariance.py for float caches: A's 5 drafted tokens as one verify frame beside B's and
    C's decode tokens in one batch give every row the bits of its one-token steps alone, over quantized caches."""
    store = tiny_store
    cfg = LayerStore(store).config
    ref = ReferenceModel(store, compute)
    shard = Shard(LayerStore(store), Windows(((0, cfg.n_layers),), cfg.n_layers, True), compute, budget=0,
                  kv_dtype=kv)
    prompts = {r: ref.codec.encode(p) for r, p in zip("ABC", ["the cat sat", "a b c d e", "hello there"])}
    drafts = {"A": [5, 9, 11, 3, 7], "B": [4], "C": [8]}
    try:
        def prefill(tag: str) -> dict:
            caches = {}
            for r, ids in prompts.items():
                caches[r] = shard.cache_for(f"{tag}{r}", 0, len(ids) + 8, len(ids))
                shard.compute(shard.embed(ids), caches[r], 0, 0)
            return caches

        steps = prefill("steps-")
        assert all(stored_as(t, cfg.head_dim) == kv for t in steps["A"].kv.values())
        alone = {r: torch.cat([shard.compute(shard.embed([t]), steps[r], len(prompts[r]) + i, 0)[0]
                               for i, t in enumerate(drafts[r])]) for r in "ABC"}
        batch = prefill("batch-")
        together, _ = shard.compute_batch([(shard.embed(drafts[r]), batch[r], len(prompts[r])) for r in "ABC"], 0)
        for r, rows in zip("ABC", together):
            assert torch.equal(rows, alone[r]), r
        written = len(prompts["A"]) + len(drafts["A"])
        assert torch.equal(batch["A"].kv[0][:, :, :written], steps["A"].kv[0][:, :, :written])  # the bytes stored
    finally:
        shard.close()


def test_the_reference_with_int8_kv_stays_close_to_float_and_int4_further(tiny_store):
    store = tiny_store
    ids = list(range(3, 40))
    logits = {}
    for kv in (FLOAT, INT8, INT4):
        ref = ReferenceModel(store, torch.float32, kv)
        logits[kv.name] = ref.step_all(ids, 0, ref.new_cache(len(ids))).log_softmax(-1)

    def kl(name: str) -> float:
        p = logits["float"].exp()
        return float((p * (logits["float"] - logits[name])).sum(-1).mean())

    assert 0 < kl("int8") < kl("int4")
    assert kl("int8") < 1e-3


def test_prima_ctl_run_takes_kv_dtype_and_refuses_a_bad_one(tiny_store):
    res = ctl_here("run", "--model", str(tiny_store), "--raw", "--max-tokens", "6", "--temperature", "0",
                   "--kv-dtype", "int8", "--json", "hello there")
    assert res.returncode == 0, res.stderr
    ref = ReferenceModel(tiny_store, kv_dtype=INT8)
    expected = [t.token_id for t in ref.generate("hello there", GenerateParams(max_tokens=6), raw=True)]
    assert json.loads(res.stdout.strip().splitlines()[-1])["tokens"] == expected
    bad = ctl_here("run", "--model", str(tiny_store), "--kv-dtype", "int3", "hi")
    assert bad.returncode == 2
    assert_one_line_error(bad, "--kv-dtype must be one of auto, float, int8, int4, got int3")


def test_the_prefix_cache_keeps_and_gives_quantized_rows_as_they_are(tiny_store):
    """The prefix cache slices and copies a layer's tensor whatever its dtype: a request that takes a prefix of
    int8 rows holds the very bytes the first request stored."""
    cfg = LayerStore(tiny_store).config
    first = KVCache(list(range(cfg.n_layers)), cfg, 64, torch.float32, INT8)
    for t in first.kv.values():
        t.copy_(INT8.pack(torch.randn(2, cfg.n_kv_heads, 64, cfg.head_dim), torch.float32))
    prefixes = PrefixCache()
    prefixes.save("k", 40, first.kv)
    second = KVCache(list(range(cfg.n_layers)), cfg, 64, torch.float32, INT8)
    prefixes.take("k", 40, second)
    assert all(torch.equal(second.kv[i][:, :, :40], first.kv[i][:, :, :40]) for i in first.kv)
    assert prefixes.nbytes() == kv_bytes(cfg, torch.float32, cfg.n_layers, 40, INT8)
