"""Prefixes on disk in one process: files keyed by model, window, KV dtype and prefix key; any dtype's rows back as
they were; a flipped byte or a stale file detected and never used; the LRU bound; atomic writes; and a shard that
loads a prefix another shard of the same windows wrote (its logits those of a full prefill), tiny synthetic model."""

import asyncio
import os
import time

import pytest
import torch

from nodes.engine.prefix_cache import Prefix, block_keys
from nodes.engine.prefix_disk import PrefixDisk
from nodes.engine.shard import Shard
from nodes.errors import PrefixMissed
from nodes.ring.prefixes import HeadPrefixes
from prima_rpc.spec.windows import Windows


def rows(window, length=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: (torch.randn(2, 2, length, 8, generator=g) * 50).to(dtype) for i in range(*window)}


def disk(tmp_path, bound=1 << 20, model="m", kv_dtype="float32"):
    return PrefixDisk(tmp_path, bound, model, kv_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_rows_of_any_dtype_come_back_bit_for_bit(tmp_path, dtype):
    d, kv = disk(tmp_path, kv_dtype=str(dtype)), rows((2, 5), dtype=dtype)
    d.write((2, 5), "k1", 64, kv)
    d.flush()
    length, got = d.read((2, 5), "k1")
    assert length == 64 and got.keys() == kv.keys()
    assert all(got[i].dtype == dtype and torch.equal(got[i], kv[i]) for i in kv)
    assert d.has([(2, 5)], "k1") and not d.has([(2, 5), (5, 6)], "k1")
    assert d.held_bytes([(2, 5)]) == os.path.getsize(d.path((2, 5), "k1")) and d.held_bytes([(0, 2)]) == 0


def test_another_model_window_or_kv_dtype_does_not_see_the_file(tmp_path):
    d = disk(tmp_path)
    d.write((0, 3), "k", 64, rows((0, 3)))
    d.flush()
    assert disk(tmp_path, model="other").read((0, 3), "k") is None
    assert disk(tmp_path, kv_dtype="int8").read((0, 3), "k") is None
    assert d.read((0, 2), "k") is None and d.read((0, 3), "k") is not None


def test_a_flipped_byte_is_detected_and_the_file_dropped(tmp_path):
    d = disk(tmp_path)
    d.write((0, 2), "k", 64, rows((0, 2)))
    d.flush()
    path = d.path((0, 2), "k")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of a tensor's bytes
    path.write_bytes(bytes(data))
    assert d.read((0, 2), "k") is None and not path.exists()


def test_a_file_renamed_to_another_key_is_stale_and_not_used(tmp_path):
    d = disk(tmp_path)
    d.write((0, 2), "a", 64, rows((0, 2)))
    d.flush()
    os.replace(d.path((0, 2), "a"), d.path((0, 2), "b"))  # a valid checksum, but written for prefix a
    assert d.read((0, 2), "b") is None and not d.path((0, 2), "b").exists()


def test_the_bound_evicts_the_least_recently_used_and_reads_renew(tmp_path):
    one = len(disk(tmp_path)._encode((0, 2), "x", 64, rows((0, 2))))
    d = disk(tmp_path, bound=3 * one)
    for i, key in enumerate("abc"):
        d.write((0, 2), key, 64, rows((0, 2), seed=i))
        d.flush()
        os.utime(d.path((0, 2), key), (time.time() - 100 + i, time.time() - 100 + i))  # a, b, c: oldest first
    assert d.read((0, 2), "a") is not None  # a is used again: b is the oldest now
    d.write((0, 2), "d", 64, rows((0, 2)))
    d.flush()
    assert [d.has([(0, 2)], k) for k in "abcd"] == [True, False, True, True]
    assert d.held_bytes([(0, 2)]) <= 3 * one
    d.write((0, 2), "big", 64 * 4, rows((0, 2), length=64 * 4))  # over the whole bound: not written
    d.flush()
    assert not d.has([(0, 2)], "big") and d.has([(0, 2)], "d")


def test_writes_leave_no_temporary_and_old_leftovers_are_cleaned(tmp_path):
    leftover = tmp_path / ".tmp-stopped"
    leftover.write_bytes(b"half")
    os.utime(leftover, (time.time() - 3600, time.time() - 3600))
    d = disk(tmp_path)
    assert not leftover.exists()
    d.write((0, 2), "k", 64, rows((0, 2)))
    d.close()
    assert [p.name for p in tmp_path.iterdir()] == [d.path((0, 2), "k").name]


@pytest.fixture(scope="module")
def store(tiny_store):
    from nodes.engine.store import LayerStore

    return LayerStore(tiny_store)


def shard_of(store, ranges, directory, head=True):
    d = PrefixDisk(directory, 1 << 26, store.model_id, "float32")
    return Shard(store, Windows(tuple(ranges), store.config.n_layers, head), torch.float32, disk=d)


def logits(shard, request_id, ids, pos, capacity, prefix=Prefix()):
    cache = shard.cache_for(request_id, pos, capacity, len(ids) - pos, prefix)
    h, _ = shard.compute(shard.embed(ids[pos:]), cache, pos, 0)
    shard.release(request_id)
    return shard.logits(h)


def test_a_new_shard_of_the_same_windows_loads_the_prefix_and_gives_a_full_prefills_logits(store, tmp_path):
    ids = torch.randint(0, 200, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    first = shard_of(store, [(0, store.config.n_layers)], tmp_path)
    cold = logits(first, "cold", ids, 0, 160)
    logits(first, "saver", ids[:140], 0, 150, Prefix(save_key="p", save_len=128, prefill=True))
    first.close()  # its writes are done
    assert first.disk.held_bytes(first.windows.ranges) > 0
    restarted = shard_of(store, [(0, store.config.n_layers)], tmp_path)
    assert restarted.prefixes.positions() == 0
    warm = logits(restarted, "warm", ids, 128, 160, Prefix("p", 128, prefill=True))
    assert torch.equal(warm, cold) and restarted.disk_loaded == 128 and restarted.prefixes.positions() == 128
    moved = shard_of(store, [(0, 4)], tmp_path, head=False)  # a re-plan that moved the window: its files differ
    with pytest.raises(PrefixMissed):
        moved.cache_for("r", 128, 160, 22, Prefix("p", 128, prefill=True))
    assert "r" not in moved.caches and moved.disk_loaded == 0


def test_a_corrupt_file_makes_the_shard_miss_and_a_full_prefill_is_still_right(store, tmp_path):
    ids = torch.randint(0, 200, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    first = shard_of(store, [(0, store.config.n_layers)], tmp_path)
    cold = logits(first, "cold", ids, 0, 160)
    logits(first, "saver", ids[:140], 0, 150, Prefix(save_key="p", save_len=128, prefill=True))
    first.close()
    path = first.disk.path((0, store.config.n_layers), "p")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = shard_of(store, [(0, store.config.n_layers)], tmp_path)
    with pytest.raises(PrefixMissed):
        restarted.cache_for("warm", 128, 160, 22, Prefix("p", 128, prefill=True))
    assert torch.equal(logits(restarted, "again", ids, 0, 160), cold)  # what the head does next: prefill from 0


def test_the_head_takes_the_longest_prefix_on_its_disk_until_a_node_lacks_it():
    async def go():
        heads = HeadPrefixes()
        prompt = list(range(300))  # 4 whole blocks; usable: the first 4 (the last token stays to compute)
        keys = block_keys(prompt)
        files = {keys[1], keys[2]}  # a restart: the index is empty, the disk holds the prefixes of 2 and 3 blocks
        plan = heads.plan(prompt, None, files.__contains__)
        assert (plan.use_key, plan.use_len, plan.save_len) == (keys[2], 192, 256)
        heads.settled(plan, prompt, saved=False)
        heads.missed(keys[2])  # a node lacked it: not asked for again this epoch, the shorter one is
        again = heads.plan(prompt, None, files.__contains__)
        assert (again.use_key, again.use_len) == (keys[1], 128)
        heads.settled(again, prompt, saved=True)
        heads.renew(5)  # a new assignment: the disk may hold it again
        assert heads.plan(prompt, None, files.__contains__).use_len == 192

    asyncio.run(go())
