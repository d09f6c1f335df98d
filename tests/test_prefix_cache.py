"""The prefix cache's decisions and copies in one process: block keys, the node's LRU inside its KV room, the
head's plan of what a prompt takes and gives, and a shard whose cached prefix gives the same logits as a full
prefill (tiny synthetic model)."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from nodes.engine.prefix_cache import BLOCK, Prefix, PrefixCache, block_keys
from nodes.engine.shard import Shard
from nodes.errors import PrefixMissed
from nodes.ring.prefixes import HeadPrefixes
from prima_rpc.spec.windows import Windows


def test_block_keys_chain_whole_blocks_only():
    a, b = list(range(200)), list(range(130)) + [7] * 70
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 200 // BLOCK == 3 and len(block_keys(a[:63])) == 0
    assert ka[:2] == kb[:2] and ka[2] != kb[2]  # the same first 128 tokens, then not
    assert block_keys([1] + a[1:])[0] != ka[0]


def kv(n_layers=2, length=8, fill=1.0):
    return {i: torch.full((2, 1, length, 4), fill + i) for i in range(n_layers)}


def new_cache(kv: dict[int, torch.Tensor]) -> SimpleNamespace:
    """What PrefixCache.take gives positions to (a model.KVCache's fields)."""
    return SimpleNamespace(kv=kv, capacity=next(iter(kv.values())).shape[2], shared_bytes=0)


def test_take_copies_a_saved_prefix_and_misses_what_it_lacks():
    cache = PrefixCache()
    cache.save("k", 4, kv(fill=3.0))
    assert cache.positions() == 4 and cache.nbytes() == 2 * 2 * 4 * 4 * 4
    into = new_cache(kv(fill=0.0))
    cache.take("k", 3, into)
    assert torch.equal(into.kv[1][:, :, :3], torch.full((2, 1, 3, 4), 4.0)) and into.kv[1][0, 0, 3, 0] == 1.0
    with pytest.raises(PrefixMissed) as err:
        cache.take("k", 5, into)  # longer than held
    assert err.value.code.name == "ABORTED" and "not cached" in str(err.value)
    with pytest.raises(PrefixMissed):
        cache.take("other", 1, into)


def test_eviction_drops_the_least_recently_used():
    cache = PrefixCache()
    for key in "abc":
        cache.save(key, 2, kv())
    cache.take("a", 2, new_cache(kv()))  # a is used again: b is now the oldest
    assert cache.evict_one() and list(cache.entries) == ["c", "a"]


def run(coro):
    return asyncio.run(coro)


def test_the_head_plans_use_and_save_by_whole_blocks():
    async def go():
        heads = HeadPrefixes()
        first = list(range(300))  # 4 whole blocks
        plan = heads.plan(first, None)
        assert (plan.use_len, plan.save_len) == (0, 256) and plan.save_key == block_keys(first)[-1]
        chunk = plan.chunk(0, 256, use=True)  # the chunk holding position 255 saves
        assert chunk == Prefix("", 0, plan.save_key, 256, prefill=True)
        assert plan.chunk(256, 44, use=False).save_key == ""
        heads.settled(plan, first, saved=True)
        second = first + list(range(1000, 1100))  # 400 tokens: 6 whole blocks, the first 4 cached
        plan2 = heads.plan(second, None)
        assert (plan2.use_key, plan2.use_len, plan2.save_len) == (plan.save_key, 256, 384)
        again = heads.plan(first[:256], None)  # a prompt of exactly the prefix leaves its last block to compute
        assert again.use_len == 192 and again.save_key == ""
        return heads

    run(go())


def test_a_sibling_waits_for_the_prefill_in_flight_and_room_forgets_old_prefixes():
    async def go():
        heads = HeadPrefixes()
        prompt = list(range(200))
        plan = heads.plan(prompt, None)
        waiter = heads.waits_for(prompt)  # n > 1: the second choice waits for the first's prefill
        assert waiter is not None and not waiter.done()
        heads.settled(plan, prompt, saved=True)
        assert waiter.done() and heads.waits_for(prompt) is None
        assert heads.plan(prompt, None).use_len == 192
        heads.fit(100)  # the ring has 100 positions free beside its requests: the 192 cached go
        assert heads.positions() == 0 and heads.plan(prompt, 50).use_len == 0  # and no room to keep it
        heads.renew(7)
        assert heads.epoch == 7 and not heads.entries

    run(go())


@pytest.fixture(scope="module")
def shard(tiny_store):
    from nodes.engine.store import LayerStore

    store = LayerStore(tiny_store)
    return Shard(store, Windows(((0, store.config.n_layers),), store.config.n_layers, True), torch.float32)


def prefill(shard, request_id, ids, pos, capacity, prefix=Prefix()):
    cache = shard.cache_for(request_id, pos, capacity, len(ids) - pos, prefix)
    h, _ = shard.compute(shard.embed(ids[pos:]), cache, pos, 0)
    return shard.logits(h)


def test_a_cached_prefix_gives_the_logits_of_a_full_prefill(shard):
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (150,)).tolist()
    cold = prefill(shard, "cold", ids, 0, 160)
    first = prefill(shard, "first", ids[:140], 0, 150, Prefix(save_key="p", save_len=128, prefill=True))
    assert shard.prefixes.positions() == 128 and first.shape == cold.shape
    warm = prefill(shard, "warm", ids, 128, 160, Prefix("p", 128, prefill=True))
    assert torch.equal(warm, cold)
    for rid in ("cold", "first", "warm"):
        shard.release(rid)
    with pytest.raises(PrefixMissed):
        prefill(shard, "gone", ids, 64, 160, Prefix("nope", 64))
    assert "gone" not in shard.caches


@pytest.mark.parametrize("fields", [dict(prefix_key="p", prefix_len=0), dict(save_key="p", save_len=0),
                                    dict(prefix_key="p", prefix_len=64, start_pos=0), dict(save_key="k" * 300)])
def test_a_frame_with_a_broken_prefix_is_refused_before_use(fields):
    from nodes.errors import Rejected
    from nodes.ring.admit import check_structure
    from prima_rpc.v1 import prima_pb2 as pb

    with pytest.raises(Rejected, match="prefix"):
        check_structure(pb.Frame(kind=pb.FORWARD, request_id="r", **fields))
