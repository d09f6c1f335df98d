"""Weights over the ring: a node without the model fetches its windows' files from another node, verified.

Real prima-node processes on loopback serve; the fetcher writes real files into a temporary cache."""

import asyncio
import json
import os
import re
import shutil
import signal
import time

import pytest

from nodes.ring.fetch import PART, Fetcher, read_manifest_from, safe_name
from prima_rpc.app import ring
from prima_rpc.app.local_ring import wait_serving
from prima_rpc.spec.manifest import MANIFEST, StoreError, read_manifest
from tests.ctl import ctl
from tests.rings import greedy_tokens, local_ring, stream_and_signal

TOKEN = "fetch-secret"
UNITS = ["layer.2", "layer.3"]


@pytest.fixture(scope="module")
def server(tiny_store, tmp_path_factory):
    with local_ring(tiny_store, 1, tmp_path_factory.mktemp("serve"), token=TOKEN) as local:
        yield local


def fetch(server, cache, units=UNITS, token=TOKEN, model_id=None, tiny_store=None):
    model_id = model_id or read_manifest(tiny_store)[1]

    async def run():
        fetcher = Fetcher(cache, model_id, server.addresses, token)
        try:
            store = await fetcher.store(units, head=False)
        finally:
            await fetcher.close()
        return store, fetcher.fetched

    return asyncio.run(run())


@pytest.mark.slow
def test_fetches_exactly_the_assigned_units_verified(server, tiny_store, tmp_path):
    store, fetched = fetch(server, tmp_path, tiny_store=tiny_store)
    manifest, model_id = read_manifest(tiny_store)
    names = {p.relative_to(store.root).as_posix() for p in store.root.rglob("*") if p.is_file()}
    assert names == {MANIFEST, manifest.tokenizer, *(store.entry(u).path for u in UNITS)}
    for unit in UNITS:
        assert (store.root / store.entry(unit).path).read_bytes() == (tiny_store / store.entry(unit).path).read_bytes()
    assert store.model_id == model_id and fetched > sum(store.entry(u).bytes for u in UNITS)


@pytest.mark.slow
def test_an_interrupted_transfer_resumes_without_refetching_complete_files(server, tiny_store, tmp_path):
    store, _ = fetch(server, tmp_path, tiny_store=tiny_store)
    # As a transfer killed half-way leaves it: layer.2 complete, half of layer.3 in its .part file.
    done, half = (store.root / store.entry(u).path for u in UNITS)
    size = half.stat().st_size
    half.with_name(half.name + PART).write_bytes(half.read_bytes()[:size // 2])
    half.unlink()
    inode = done.stat().st_ino
    store, fetched = fetch(server, tmp_path, tiny_store=tiny_store)
    assert fetched == size - size // 2  # only the missing half came over the wire
    assert done.stat().st_ino == inode and half.read_bytes() == (tiny_store / half.name).read_bytes()


@pytest.mark.slow
def test_a_corrupted_chunk_is_detected_and_refetched(server, tiny_store, tmp_path):
    store, _ = fetch(server, tmp_path, tiny_store=tiny_store)
    path = store.root / store.entry("layer.3").path
    good = path.read_bytes()
    bad = bytearray(good[:len(good) // 2])
    bad[100] ^= 0xFF  # one flipped byte in the part already received
    path.with_name(path.name + PART).write_bytes(bytes(bad))
    path.unlink()
    store, fetched = fetch(server, tmp_path, tiny_store=tiny_store)
    assert path.read_bytes() == good
    assert fetched == len(good) - len(bad) + len(good)  # the rest, then (the checksum failed) all of it again


@pytest.mark.slow
def test_without_the_token_a_transfer_is_refused(server, tiny_store, tmp_path):
    with pytest.raises(StoreError, match="UNAUTHENTICATED"):
        fetch(server, tmp_path, token=None, tiny_store=tiny_store)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


@pytest.mark.slow
def test_another_model_is_refused(server, tmp_path):
    with pytest.raises(StoreError, match="FAILED_PRECONDITION.*does not hold that model"):
        fetch(server, tmp_path, model_id="0" * 64)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "a\\..\\x", "", "a//b"])
def test_unsafe_names_are_refused(name):
    with pytest.raises(StoreError, match="refused"):
        safe_name(name)


def test_a_manifest_naming_dotdot_is_refused(tiny_store, tmp_path):
    data = json.loads((tiny_store / MANIFEST).read_text())
    data["files"]["layers"][0]["path"] = "../x"
    bad = tmp_path / "manifest.json.part"
    bad.write_text(json.dumps(data))
    with pytest.raises(StoreError, match=r"'\.\./x'.*refused"):
        read_manifest_from(bad)


@pytest.mark.slow
def test_a_transfer_that_does_not_fit_the_disk_is_refused(server, tiny_store, tmp_path, monkeypatch):
    # A mock for a fault this machine cannot cause: a full disk.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    with pytest.raises(StoreError, match="fetching needs .* MiB free"):
        fetch(server, tmp_path, tiny_store=tiny_store)
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name.startswith("layer")]
    assert os.path.isdir(tmp_path)


@pytest.mark.slow
def test_only_the_head_has_the_model_ring_equals_reference(smol_store, tmp_path):
    prompt, max_tokens = "Write a short story about a lighthouse keeper.", 64
    expected = greedy_tokens(smol_store, prompt, max_tokens)
    caches = [tmp_path / f"cache{i}" for i in range(3)]
    with local_ring(None, 3, tmp_path, models=[smol_store, None, None],
                    extra_args=[["--cache", str(c)] for c in caches]) as local:
        started = ctl("--node", local.addresses[0], "start", "--windows", "10,10,10", timeout=300)
        assert started.returncode == 0, started.stderr
        for address in local.addresses[1:]:  # the transfer per node: bytes and rate
            assert re.search(rf"fetched {address} (\d+)/\1 MiB", started.stderr), started.stderr
        status = ctl("--node", local.addresses[0], "status", "--json", timeout=60)
        rows = json.loads(status.stdout)["nodes"]
        assert [r["cached_units"] for r in rows] == [32, 10, 10] and rows[0]["fetched_bytes"] == 0
        assert all(r["fetched_bytes"] > 0 for r in rows[1:])
        nodes = ring.walk(local.addresses[0])
        assert [i.role for _, i in nodes] == ["head", "worker", "worker"]
        manifest, model_id = read_manifest(smol_store)
        held = {p.relative_to(caches[2] / model_id).as_posix() for p in caches[2].rglob("*") if p.is_file()}
        own = [i for r in nodes[2][1].windows for i in range(r.start, r.stop)]
        assert held == {MANIFEST, manifest.tokenizer, *(manifest.layers[i].path for i in own)}
        assert not caches[0].exists()
        # Kill a worker mid-generation: the head and node 2 fetch what it held, the stream goes on unchanged.
        tokens, done, _ = asyncio.run(stream_and_signal(local.addresses[0], prompt, max_tokens, local.processes[1].pid,
                                                        signal.SIGKILL, after=8))
        assert tokens == expected and done.completion_tokens == len(expected)
        survivors = ring.walk(local.addresses[0])
        assert [a for a, _ in survivors] == [local.addresses[0], local.addresses[2]]
        assert survivors[1][1].cached_units > 10  # it fetched layers the lost node held


@pytest.mark.slow
def test_the_serving_node_killed_half_way_the_next_fetch_resumes(smol_store, tmp_path):
    units = ["layer.0", "layer.1"]
    store, model_id = read_manifest(smol_store)
    first, second = (store.units()[u] for u in units)
    with local_ring(smol_store, 1, tmp_path / "logs") as local:
        def kill_in_the_second_file(done, total, unit):
            if unit == units[1] and done > first.bytes + second.bytes // 2 and local.processes[0].poll() is None:
                local.processes[0].send_signal(signal.SIGKILL)
                local.processes[0].wait()

        async def run(progress):
            fetcher = Fetcher(tmp_path / "cache", model_id, local.addresses, None, progress)
            try:
                await fetcher.store(units, head=False)
            finally:
                await fetcher.close()
            return fetcher.fetched

        with pytest.raises(StoreError, match="UNAVAILABLE"):
            asyncio.run(run(kill_in_the_second_file))
        root = tmp_path / "cache" / model_id
        complete, part = root / first.path, root / (second.path + PART)
        assert complete.stat().st_size == first.bytes and 0 < part.stat().st_size < second.bytes
        inode, had = complete.stat().st_ino, part.stat().st_size
        local.start_node(0)  # the same port
        wait_serving(local.addresses[0], local.processes[0], 60)
        fetched = asyncio.run(run(lambda *a: None))
        assert fetched == second.bytes - had  # neither the complete file nor the part came again
        assert complete.stat().st_ino == inode
        assert (root / second.path).read_bytes() == (smol_store / second.path).read_bytes()


@pytest.mark.slow
def test_a_restarted_node_reuses_its_cache_and_a_relay_fetches_nothing(tiny_store, tmp_path):
    cache = tmp_path / "cache"
    with local_ring(None, 3, tmp_path, models=[tiny_store, None, None],
                    extra_args=[[], ["--cache", str(cache)], ["--cache", str(tmp_path / "relay")]]) as local:
        nodes = ring.start(local.addresses[0], [4, 4, 0])
        assert nodes[1][1].fetched_bytes > 0 and nodes[1][1].cached_units == 4
        assert nodes[2][1].role == "relay" and nodes[2][1].fetched_bytes == 0
        assert not (tmp_path / "relay").exists()
        # node1 is the head's standby (its successor): its copy of the head's units comes in the background
        deadline = time.monotonic() + 30
        while not ring.walk(local.addresses[0])[1][1].head_copy and time.monotonic() < deadline:
            time.sleep(0.3)
        local.processes[1].terminate()
        local.processes[1].wait()
        local.start_node(1)
        wait_serving(local.addresses[1], local.processes[1], 60)
        # A slow restart (a busy machine) lets the head route around node1 first: wait until it has rejoined.
        deadline = time.monotonic() + 30
        while len(ring.walk(local.addresses[0])) < 3 and time.monotonic() < deadline:
            time.sleep(0.3)
        nodes = ring.start(local.addresses[0], [4, 4, 0])
        # its 4 units and, as the head's standby (its successor), the head's: embedding, output head, 4 layers
        assert nodes[1][1].loaded and nodes[1][1].fetched_bytes == 0 and nodes[1][1].cached_units == 10
