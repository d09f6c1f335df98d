"""A cached prefix shared copy-on-write: requests map its pages (one copy held however many use it, the request
that saved it included), a write to a mapped position stays the writer's own, the prefix is not evicted while
mapped, and requests on one shared prefix give a full prefill's logits alone and decoding in one batch (tiny
synthetic model, float32: the C paths)."""

from types import SimpleNamespace

import pytest
import torch

from nodes.engine.kv_share import PAGE, SharedPrefix, mapped_cache, shareable
from nodes.engine.prefix_cache import Prefix, PrefixCache
from nodes.engine.shard import Shard
from prima_rpc.spec.windows import Windows

pytestmark = pytest.mark.skipif(not shareable(torch.empty(2, 1, PAGE // 64, 16)), reason="no memfd (not Linux)")


def prefix_rows(length=128, seed=0):
    return torch.randn(2, 2, length, 16, generator=torch.Generator().manual_seed(seed))  # 64 bytes a position


def test_a_request_maps_the_prefix_pages_and_its_writes_stay_its_own():
    rows = prefix_rows(length=130 // 64 * 64)
    held = SharedPrefix(rows)
    a, shared = mapped_cache(held, torch.empty(2, 2, 200, 16), 128)
    b, _ = mapped_cache(held, torch.empty(2, 2, 200, 16), 100)  # 100 positions: one whole page a row, then copied
    assert a.shape[2] >= 200 and a.is_contiguous() and shared == 4 * 128 * 64
    assert torch.equal(a[:, :, :128], rows) and torch.equal(b[:, :, :100], rows[:, :, :100])
    held.full[0, 0, 5] = 9.0  # the prefix's own memory (never done in use): the requests see it, so they share it
    assert (a[0, 0, 5] == 9.0).all() and (b[0, 0, 5] == 9.0).all()
    held.full[0, 0, 5] = rows[0, 0, 5]
    a[1, 1, 3] = 7.0  # a request writing a mapped position (a ring wrapping) gets its own copy of that page
    assert torch.equal(held.tensor, rows) and torch.equal(b[:, :, :100], rows[:, :, :100])
    a[:, :, 128:] = 1.0  # its own positions, past the prefix
    assert torch.equal(held.tensor, rows)


def new_cache(capacity):
    return SimpleNamespace(kv={0: torch.zeros(2, 2, capacity, 16)}, capacity=capacity, shared_bytes=0)


def test_the_cache_holds_a_prefix_once_and_keeps_it_while_mapped():
    cache = PrefixCache()
    cache.save("p", 128, {0: prefix_rows()})
    cache.save("q", 128, {0: prefix_rows(seed=1)})
    users = [new_cache(300) for _ in range(4)]
    for i, user in enumerate(users):
        cache.take("p", 128, user, f"r{i}")
        assert torch.equal(user.kv[0][:, :, :128], cache.rows("p")[0])
    one = 2 * 2 * 128 * 64
    assert cache.nbytes() == 2 * one and all(u.shared_bytes == one for u in users)  # four users, one copy
    assert cache.evict_one() and list(cache.entries) == ["p"]  # q goes first although p is older: p is mapped
    assert not cache.evict_one()
    for i in range(4):
        cache.release(f"r{i}")
    assert cache.evict_one() and not cache.entries
    copied = PrefixCache(share=False)
    copied.save("p", 128, {0: prefix_rows()})
    user = new_cache(300)
    copied.take("p", 128, user, "r")
    assert user.shared_bytes == 0 and torch.equal(user.kv[0][:, :, :128], prefix_rows())


@pytest.fixture(scope="module")
def shard(tiny_store):
    from nodes.engine.store import LayerStore

    store = LayerStore(tiny_store)
    return Shard(store, Windows(((0, store.config.n_layers),), store.config.n_layers, True), torch.float32)


def test_requests_on_one_shared_prefix_give_full_prefill_logits_alone_and_in_a_batch(shard):
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 200, (128,), generator=g).tolist()
    tails = [torch.randint(0, 200, (10 + i,), generator=g).tolist() for i in range(3)]
    saver = shard.cache_for("saver", 0, 140, 130, Prefix(save_key="sys", save_len=128, prefill=True))
    shard.compute(shard.embed(system + [5, 6]), saver, 0, 0)
    held = shard.prefixes.nbytes()
    assert saver.shared_bytes == held  # the request that saved the prefix maps the saved pages too: one copy
    assert not shard.prefixes.evict_one()  # while it is in use
    shard.release("saver")
    caches, firsts, tail_logits = [], [], []
    for i, tail in enumerate(tails):
        cache = shard.cache_for(f"r{i}", 128, 160, len(tail), Prefix("sys", 128, prefill=True))
        h, _ = shard.compute(shard.embed(tail), cache, 128, 0)
        caches.append(cache)
        tail_logits.append(shard.logits(h))
        firsts.append(int(tail_logits[-1].argmax()))
    assert all(c.shared_bytes > 0 for c in caches) and shard.prefixes.nbytes() == held
    own = sum(c.nbytes() for c in caches)  # each request's own bytes: its tail, not the prefix
    assert own + held < sum(c.nbytes() + c.shared_bytes for c in caches)
    batched, _ = shard.compute_batch([(shard.embed([t]), c, 128 + len(tail))
                                      for t, c, tail in zip(firsts, caches, tails, strict=True)], 0)
    for i, (tail, first) in enumerate(zip(tails, firsts, strict=True)):
        shard.release(f"r{i}")
        cold = shard.cache_for(f"cold{i}", 0, 160, 130)  # computed as the shared one was, in its own cache
        shard.compute(shard.embed(system + [5, 6]), cold, 0, 0)
        h, _ = shard.compute(shard.embed(tail), cold, 128, 0)
        assert torch.equal(shard.logits(h), tail_logits[i])
        alone, _ = shard.compute(shard.embed([first]), cold, 128 + len(tail), 0)
        shard.release(f"cold{i}")
        assert torch.equal(batched[i], alone)  # the same bits, shared or copied, alone or in a batch
