"""The device profiler: sane figures for this machine, the solver's JSON schema, the cache, OS rules, the link."""

import asyncio
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from nodes.engine.prefetch import DEFAULT_FRACTION
from nodes.errors import LinkDown
from nodes.profiling import disk as profile_disk
from nodes.profiling import profiler
from nodes.profiling.compute import LOSS_MIN_STEPS, LOSS_PAIRS
from nodes.profiling.disk import measure_disk
from nodes.profiling.host import available_ram, gpu_info, os_kind, parse_meminfo, parse_vm_stat, ram_rule
from nodes.profiling.profiler import FORMAT, LinkRates, measure_link, profile_device, read_cache
from nodes.ring.config import NodeConfig
from nodes.ring.link import RingLink
from nodes.ring.main import serve
from prima_rpc.spec.profiles import DeviceProfile, devices_from_json

GiB = 1 << 30


def listing(*dirs: Path) -> dict[Path, set[str]]:
    return {d: set(os.listdir(d)) for d in dirs}


# ------------------------------------------------------------------ this machine, measured once


@pytest.fixture(scope="module")
def measured(tiny_store, tmp_path_factory):
    """One real profile of this machine: its disk probe writes (and removes) a temp file in the store."""
    cache_dir = tmp_path_factory.mktemp("profile-cache")
    before = listing(tiny_store, cache_dir)
    start = time.perf_counter()
    prof = asyncio.run(profile_device("here", tiny_store, None, cache_path=cache_dir / "p.json", is_head=True))
    return prof, time.perf_counter() - start, cache_dir / "p.json", before


@pytest.mark.slow  # one real profile of this machine: 11 s
def test_profile_of_this_machine_is_sane_and_bounded(measured):
    prof, took, path, _ = measured
    assert took < 60, f"profiling took {took:.1f} s"  # a bound against a hang on a busy machine, not a speed check
    assert prof.name == "here" and prof.is_head and prof.os == "linux"
    doc = json.loads(path.read_text())
    assert doc["details"]["matmul_cpu"]["gemv"] > 1e9  # the raw roofline rate
    # With a store the CPU rates are the tiny model's own decode layer: small layers, small rates.
    decode = doc["details"]["decode_layer"]
    assert decode["layer_s"] > 0 and prof.cpu_flops == pytest.approx(decode["flops_rate"])
    assert prof.ram_bandwidth == pytest.approx(decode["bytes_rate"]) and prof.ram_bandwidth > 1e6
    assert prof.disk_seq_read > 1e7 and prof.disk_rand_read > 1e7, prof
    assert 0 < prof.ram_available <= psutil.virtual_memory().total, prof
    if prof.gpu_kind == "none":
        assert prof.gpu_flops == 0 and prof.vram_free == 0 and prof.vram_bandwidth == 0
    assert prof.link_latency_s == 0 and prof.link_bandwidth == profiler.NO_LINK_BANDWIDTH  # no successor
    assert 0 < prof.frame_s < 0.1, prof  # a hop's own software cost
    assert 0 < prof.token_s < 0.1, prof  # the head's own work per token
    assert 0 < prof.output_s < 1, prof  # the tiny store's output layer, measured
    # batches of decode rows, measured on the store's layers: one row's cost at most b times, never less with more
    for curve in (prof.batch_cost, prof.output_batch_cost):
        sizes, costs = zip(*curve)
        assert sizes == (1, 2, 4, 8) and costs[0] == 1.0, curve
        assert all(a <= b <= n for a, b, n in zip(costs, costs[1:], sizes[1:])), curve
    assert prof.host == profiler.host_id() and len(prof.host) == 16  # the machine, hashed
    assert 0 <= prof.visit_s < 0.1, prof  # a window visit beyond its layers (a tiny layer: may be ~0)
    assert 0 < prof.read_cpu_s < 1e-6, prof  # the CPU a byte read costs: measured on the node's own streaming path
    assert 0 <= prof.stream_layer_s < 0.1, prof  # a streamed layer's cold start (a tiny layer: may be ~0)
    streamed = doc["details"]["streaming"]  # the run they come from streamed the store's layers
    assert streamed["layers"] >= 1 and streamed["read_cpu_s"] == prof.read_cpu_s, streamed
    loss = doc["details"]["read_loss"]  # resident steps beside a second reader: it read, and the loss is per byte
    assert loss["bytes_per_step"] > 0 and loss["read_loss_s"] == prof.read_loss_s and 0 <= prof.read_loss_s < 1e-6
    assert loss["steps"] >= 2 * LOSS_PAIRS * LOSS_MIN_STEPS  # every phase, alone and beside, timed its steps


@pytest.mark.slow  # one real profile of this machine: 11 s
def test_profile_round_trips_through_the_solver_schema(measured, tiny_store):
    prof, _, path, _ = measured
    # the default budget keeps room for its largest layer unit's read (nodes/engine/budget.py): the plan leaves it
    largest_layer = profiler._largest_layer_unit(tiny_store)
    assert largest_layer > 0
    assert DeviceProfile.from_json(json.loads(json.dumps(prof.to_json()))) == prof
    assert devices_from_json({"devices": [prof.to_json()]}) == (prof,)
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["dtype"] == "float32" and doc["link_peer"] is None
    cached = DeviceProfile.from_json(doc["profile"])  # the measurement; the reply is the node's share of it:
    # its default share of the RAM, and random reads no faster than sequential ones (a noisy probe can read so)
    ram = int(cached.ram_available * DEFAULT_FRACTION) - largest_layer
    assert prof == replace(cached, is_head=prof.is_head, ram_available=ram,
                           disk_rand_read=min(cached.disk_rand_read, cached.disk_seq_read))
    assert doc["details"]["matmul_cpu"]["gemm"] > 0 and doc["details"]["disk"]["source"] == "temp"


@pytest.mark.slow  # one real profile of this machine: 11 s
def test_profile_is_cached_and_leaves_no_temp_files(measured, tiny_store):
    prof, _, path, before = measured
    start = time.perf_counter()
    again = asyncio.run(profile_device("here", tiny_store, None, cache_path=path, is_head=True))
    assert time.perf_counter() - start < 0.5
    assert again == prof
    # Another role or name reuses the same measurements.
    assert asyncio.run(profile_device("here", tiny_store, None, cache_path=path)).is_head is False
    after = listing(tiny_store, path.parent)
    assert after[tiny_store] == before[tiny_store], "the disk probe left files in the store"
    assert after[path.parent] == before[path.parent] | {path.name}, "the cache write left files behind"


# ------------------------------------------------------------------ cache policy (probes faked)

FAKE_FIELDS = dict(os="linux", cpu_flops=1e10, gpu_flops=0.0, gpu_kind="none", ram_bandwidth=2e10,
                   vram_bandwidth=0.0, disk_seq_read=1e9, disk_rand_read=5e8, ram_available=8 * GiB, vram_free=0)


@pytest.fixture
def fake_probes(monkeypatch):
    """measure_local and measure_link replaced by counters that return fixed figures."""
    calls = {"local": 0, "link": 0}

    def local(dtype, store_dir):
        calls["local"] += 1
        return {**FAKE_FIELDS, "cpu_flops": 1e10 * calls["local"]}, {"local_s": 0.0}

    async def link(lk):
        calls["link"] += 1
        return LinkRates(lk.peer, 0.004, 0.002, 5e7, "ping-padding", 20, 1 << 20)

    monkeypatch.setattr(profiler, "measure_local", local)
    monkeypatch.setattr(profiler, "measure_link", link)
    return calls


class FakeLink:
    def __init__(self, peer: str):
        self.peer = peer


def run_profile(path: Path, link=None, **kwargs) -> DeviceProfile:
    return asyncio.run(profile_device("n1", None, link, cache_path=path, **kwargs))


def test_the_reply_is_what_the_node_will_use(fake_probes, tmp_path, monkeypatch):
    raw = FAKE_FIELDS["ram_available"]
    assert run_profile(tmp_path / "p.json").ram_available == int(raw * DEFAULT_FRACTION)
    assert run_profile(tmp_path / "p.json", mem_budget=GiB).ram_available == GiB
    assert run_profile(tmp_path / "p.json", mem_budget=64 * GiB).ram_available == raw  # no more than there is
    monkeypatch.setenv("PRIMA_DISK_MBPS", "250")
    slow = run_profile(tmp_path / "p.json")
    assert (slow.disk_seq_read, slow.disk_rand_read) == (250e6, 250e6) and fake_probes["local"] == 1


def test_cache_refresh_age_dtype_and_successor(fake_probes, tmp_path):
    path = tmp_path / "p.json"
    first = run_profile(path, FakeLink("a:1"))
    assert fake_probes == {"local": 1, "link": 1}
    assert (first.cpu_flops, first.link_latency_s, first.link_bandwidth) == (1e10, 0.002, 5e7)
    assert run_profile(path, FakeLink("a:1")) == first and fake_probes == {"local": 1, "link": 1}

    assert run_profile(path, FakeLink("b:2")).cpu_flops == 1e10  # a new successor: only the link again
    assert fake_probes == {"local": 1, "link": 2}

    assert run_profile(path, FakeLink("b:2"), refresh=True).cpu_flops == 2e10
    assert fake_probes == {"local": 2, "link": 3}

    run_profile(path, FakeLink("b:2"), dtype="bfloat16")  # FLOP/s are per dtype
    assert fake_probes["local"] == 3

    doc = json.loads(path.read_text())
    doc["measured_at"] -= profiler.MAX_AGE_S + 1
    path.write_text(json.dumps(doc))
    run_profile(path, FakeLink("b:2"), dtype="bfloat16")  # older than a day
    assert fake_probes["local"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def cache_doc(**changes) -> str:
    profile = {"name": "n1", **FAKE_FIELDS, "link_latency_s": 0.0, "link_bandwidth": 1e9, "is_head": False}
    return json.dumps({"format": FORMAT, "measured_at": time.time(), "dtype": "float32", "store_dir": None,
                       "link_peer": None, "profile": profile, "details": {}, **changes})


@pytest.mark.parametrize("content", [
    "", "{not json", '{"format": "other"}', "[]",
    cache_doc(profile={"name": "n1"}),  # not the solver's schema
    cache_doc(measured_at="yesterday"),
    cache_doc(details=None),
    cache_doc(measured_at=time.time() + 3600),  # from the future: a clock that jumped
], ids=["empty", "not-json", "format", "list", "schema", "stamp", "details", "future"])
def test_a_bad_cache_is_measured_again(fake_probes, tmp_path, content):
    path = tmp_path / "p.json"
    path.write_text(content)
    assert run_profile(path).cpu_flops == 1e10 and fake_probes["local"] == 1
    assert read_cache(path)["profile"]["cpu_flops"] == 1e10


def test_a_good_cache_is_used(fake_probes, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(cache_doc())
    assert run_profile(path).cpu_flops == FAKE_FIELDS["cpu_flops"] and fake_probes["local"] == 0
    assert read_cache(path)["profile"]["cpu_flops"] == 1e10


def test_unreachable_successor_fails_loudly_and_caches_nothing(fake_probes, monkeypatch, tmp_path):
    async def down(lk):
        raise TimeoutError

    monkeypatch.setattr(profiler, "measure_link", down)
    with pytest.raises(LinkDown, match="x:9 did not answer"):
        run_profile(tmp_path / "p.json", FakeLink("x:9"))
    assert not (tmp_path / "p.json").exists()


# ------------------------------------------------------------------ OS rules (table inputs)

MEMINFO = """MemTotal:       16318480 kB
MemFree:         1203344 kB
MemAvailable:    9876544 kB
Buffers:          310220 kB
SwapTotal:       4194300 kB
SwapFree:        2097152 kB
HugePages_Total:       0
Active(anon):    2000000 kB
"""
VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               12000.
Pages active:                            200000.
Pages inactive:                           30000.
Pages speculative:                         1000.
Pages purgeable:                           5000.
"Translation faults":                  12345678.
"""


def test_parse_meminfo_and_vm_stat():
    info = parse_meminfo(MEMINFO)
    assert info["MemAvailable"] == 9876544 * 1024 and info["SwapFree"] == 2097152 * 1024
    assert info["HugePages_Total"] == 0 and info["Active(anon)"] == 2000000 * 1024
    vm = parse_vm_stat(VM_STAT)
    assert vm["Pages free"] == 12000 * 16384 and vm["Translation faults"] == 12345678 * 16384
    with pytest.raises(ValueError, match="page size"):
        parse_vm_stat("Pages free: 3.")


@pytest.mark.parametrize("kind, meminfo, vm_stat, expected", [
    ("linux", MEMINFO, None, 9876544 * 1024),
    ("android", MEMINFO, None, (9876544 + 2097152) * 1024),  # + reclaimable swap
    ("android", "MemAvailable: 100 kB\n", None, 100 * 1024),  # no swap at all
    ("macos", None, VM_STAT, (12000 + 30000 + 5000) * 16384),  # free + inactive + purgeable
    ("macos", None, "(page size of 4096 bytes)\nPages free: 10.\nPages inactive: 2.\n", 12 * 4096),
    ("linux", "MemFree: 100 kB\n", None, ValueError),  # kernel without MemAvailable
    ("macos", None, None, ValueError),
    ("windows", MEMINFO, None, ValueError),
])
def test_ram_rule_per_os(kind, meminfo, vm_stat, expected):
    args = dict(meminfo=parse_meminfo(meminfo) if meminfo else None,
                vm_stat=parse_vm_stat(vm_stat) if vm_stat else None)
    if expected is ValueError:
        with pytest.raises(ValueError):
            ram_rule(kind, **args)
    else:
        assert ram_rule(kind, **args) == expected


@pytest.mark.parametrize("platform, env, expected", [
    ("linux", {}, "linux"),
    ("linux", {"TERMUX_VERSION": "0.118"}, "android"),
    ("linux", {"ANDROID_ROOT": "/system"}, "android"),
    ("android", {}, "android"),
    ("darwin", {}, "macos"),
    ("win32", {}, "windows"),
    ("freebsd14", {}, "linux"),
])
def test_os_kind(platform, env, expected):
    assert os_kind(platform, env) == expected


def test_available_ram_and_gpu_here():
    assert 0 < available_ram() <= psutil.virtual_memory().total
    gpu = gpu_info()
    assert gpu.kind in ("cuda", "metal", "none") and (gpu.kind == "none") == (gpu.device is None)


# ------------------------------------------------------------------ disk probe variants


def test_disk_probe_reads_a_store_s_own_files(tiny_store, monkeypatch):
    monkeypatch.setattr(profile_disk, "MIN_STORE_BYTES", 0)
    monkeypatch.setattr(profile_disk, "RAND_S", 0.1)
    before = listing(tiny_store)
    rates = measure_disk(tiny_store)
    assert rates.source == "store" and rates.method == "O_DIRECT" and rates.seq_read > 1e6
    assert listing(tiny_store) == before


def test_stream_rate_reads_layer_files_through_the_node_s_reader(tiny_store, tmp_path, monkeypatch):
    from nodes.engine import diskio

    read, seen = diskio.ChunkReader.read, []

    def spy(self, path, size, sink, ranges=None):  # the real read, recording which files it was asked for
        seen.append(Path(path).name)
        return read(self, path, size, sink, ranges)

    monkeypatch.setattr(diskio.ChunkReader, "read", spy)
    rate = 20e6  # an emulated disk: the reader hands bytes over no faster than this, so the rate is at most it
    assert 0 < profile_disk.measure_stream_rate(tiny_store, rate) <= rate
    assert seen and all(name.startswith("layer") for name in seen)  # what a prefetcher streams, not the head
    assert profile_disk.measure_stream_rate(tmp_path, 0.0) == 0.0  # no store: nothing to measure


def test_disk_probe_falls_back_to_fadvise(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "O_DIRECT")  # as on a filesystem or OS without direct I/O
    monkeypatch.setattr(profile_disk, "RAND_S", 0.2)
    (tmp_path / f"{profile_disk.PROBE_PREFIX}999999999-stale").write_bytes(b"x")  # a dead run's leftover
    rates = measure_disk(tmp_path, temp_bytes=32 << 20)
    assert rates.source == "temp" and rates.method == "fadvise"
    assert rates.seq_read > 1e7 and rates.rand_read > 1e6
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the link, over a real Ring stream


def test_link_to_a_real_node_over_the_ring_stream(fake_probes, monkeypatch, tmp_path):
    monkeypatch.setattr(profiler, "measure_link", measure_link)  # the real one; local probes stay faked

    async def scenario():
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        node = loop.create_task(serve(NodeConfig(port=0, host="127.0.0.1", peer="127.0.0.1:9", name="succ"),
                                      ready=ready.set_result))
        link = RingLink(await asyncio.wait_for(ready, 10), None)
        try:
            rates = await measure_link(link)
            prof = await profile_device("n1", None, link, cache_path=tmp_path / "p.json")
        finally:
            await link.close()
            node.cancel()
            await asyncio.gather(node, return_exceptions=True)
        return rates, prof

    rates, prof = asyncio.run(scenario())
    assert 0 < rates.rtt_s < 0.05 and rates.latency_s == rates.rtt_s / 2
    assert rates.bandwidth > 1e7 and rates.burst_bytes >= 2 << 20 and rates.method == "ping-padding"
    assert 0 < prof.link_latency_s < 0.05 and prof.link_bandwidth > 1e7
    assert read_cache(tmp_path / "p.json")["details"]["link"]["peer"] == rates.peer


def test_a_node_profiles_in_its_compute_thread(fake_probes, monkeypatch):
    """Control.Profile runs the probes where the node runs its layers: torch kernels in any other thread leave
    OpenMP workers there, which change how the compute thread's team waits (profiler.profile_device)."""
    import threading

    import grpc

    from prima_rpc.v1 import prima_pb2 as pb
    from prima_rpc.v1 import prima_pb2_grpc as rpc

    threads = []
    faked = profiler.measure_local
    monkeypatch.setattr(profiler, "measure_local",
                        lambda *a: (threads.append(threading.current_thread().name), faked(*a))[1])

    async def scenario():
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        node = loop.create_task(serve(NodeConfig(port=0, host="127.0.0.1", peer="127.0.0.1:9", name="solo"),
                                      ready=ready.set_result))
        try:
            async with grpc.aio.insecure_channel(await asyncio.wait_for(ready, 10)) as channel:
                reply = await rpc.ControlStub(channel).Profile(pb.ProfileRequest(refresh=True), timeout=30)
        finally:
            node.cancel()
            await asyncio.gather(node, return_exceptions=True)
        return json.loads(reply.json)

    assert asyncio.run(scenario())["name"] == "solo"
    assert len(threads) == 1 and threads[0].startswith("compute"), threads  # the node's pool (nodes/ring/node.py)


def test_link_to_a_dead_port_is_link_down(tmp_path):
    from prima_rpc.app.local_ring import free_ports

    async def scenario():
        link = RingLink(f"127.0.0.1:{free_ports(1)[0]}", None)
        try:
            await profiler._link_rates(link)
        finally:
            await link.close()

    with pytest.raises(LinkDown, match="profiling the link"):
        asyncio.run(scenario())
