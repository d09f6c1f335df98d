"""Prefixes on disk on a real 3-node ring (tiny synthetic model, 512 positions of KV room a node, its own prefix
folder): after every process restarted, a chat's next turn loads its prefix from disk instead of prefilling it; a
re-plan that moves windows loses only theirs; corrupt files are never used. Tokens always equal the single-process
reference."""

import json
import time

import pytest

from prima_rpc.app import ring
from prima_rpc.app.local_ring import wait_serving
from tests.ctl import ctl
from tests.rings import collect, greedy_reference, local_ring

pytestmark = pytest.mark.slow

WINDOWS = [3, 3, 2]


def stats(head: str) -> list:
    return [info.stats for _, info in ring.walk(head)]


def counters(head: str) -> list[tuple[int, int, int]]:
    """Each node's (prefilled tokens, prefix hit tokens, prefix positions read from disk), head first."""
    return [(s.prefilled_tokens, s.prefix_hit_tokens, s.prefix_disk_tokens) for s in stats(head)]


def deltas(before, after) -> list[tuple[int, ...]]:
    return [tuple(a - b for a, b in zip(x, y, strict=True)) for y, x in zip(before, after, strict=True)]


def words(n: int, seed: int) -> str:
    return " ".join(f"w{(i * 7919 + seed) % 97}" for i in range(n))


def on_disk(head: str, timeout: float = 30.0) -> list[int]:
    """Each node's prefix_disk_bytes once every node's are > 0 (the files are written on a thread of their own)."""
    deadline = time.monotonic() + timeout
    while not all(held := [s.prefix_disk_bytes for s in stats(head)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


@pytest.fixture(scope="module")
def disk_ring(tiny_store, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prefix-files")
    args = [["--mem-budget", "1", "--prefix-dir", str(folder)]] * 3
    with local_ring(tiny_store, 3, tmp_path_factory.mktemp("logs"), WINDOWS, extra_args=args) as local:
        local.folder = folder
        yield local


def restart_all(local) -> str:
    """Every node's process stopped and started again with the same command, then the same plan assigned."""
    local.stop()
    for i, address in enumerate(local.addresses):
        wait_serving(address, local.start_node(i), 60.0)
    ring.start(local.addresses[0], WINDOWS)
    return local.addresses[0]


def test_after_the_whole_ring_restarted_the_next_turn_loads_its_prefix_from_disk(disk_ring, tiny_store):
    head = disk_ring.addresses[0]
    turn1 = words(40, 1)  # about 160 tokens (a word is about 4)
    turn2 = turn1 + " " + words(20, 2)
    _, d1 = collect(head, turn1, 4, raw=True)
    assert all(on_disk(head))
    head = restart_all(disk_ring)
    res = ctl("--node", head, "status", "--json", timeout=60)
    rows = json.loads(res.stdout)["nodes"]
    assert all(r["prefix_cached_tokens"] == 0 and r["prefix_disk_bytes"] > 0 for r in rows), res.stderr
    before = counters(head)
    got, d2 = collect(head, turn2, 6, raw=True)
    assert got == greedy_reference(tiny_store, [turn2], 6, raw=True)[turn2]
    cached = d1.prompt_tokens // 64 * 64
    assert deltas(before, counters(head)) == [(d2.prompt_tokens - cached, cached, cached)] * 3


def test_a_replan_that_moves_windows_loses_only_theirs(disk_ring, tiny_store):
    head = disk_ring.addresses[0]
    prompt = words(40, 3)
    collect(head, prompt, 3, raw=True)
    held = on_disk(head)
    ring.start(head, [2, 3, 3])  # node 1 keeps layers [0, 3); node 2 and the head move
    moved = [s.prefix_disk_bytes for s in stats(head)]
    assert moved[1] == held[1] and moved[0] < held[0] and moved[2] < held[2]
    before = counters(head)
    again = prompt + " " + words(8, 4)
    got, d = collect(head, again, 4, raw=True)
    assert got == greedy_reference(tiny_store, [again], 4, raw=True)[again]
    assert [c[:2] for c in deltas(before, counters(head))] == [(d.prompt_tokens, 0)] * 3  # the head has none
    ring.start(head, WINDOWS)  # back: the files of these windows were kept
    before = counters(head)
    collect(head, prompt + " " + words(8, 5), 3, raw=True)
    assert all(hit > 0 and disk > 0 for _, hit, disk in deltas(before, counters(head)))


def test_corrupt_files_are_never_used(disk_ring, tiny_store):
    head = disk_ring.addresses[0]
    prompt = words(40, 6)
    collect(head, prompt, 3, raw=True)
    on_disk(head)
    for path in disk_ring.folder.glob("*.kv"):  # one flipped byte in every file
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    head = restart_all(disk_ring)
    before = counters(head)
    again = prompt + " " + words(8, 7)
    got, d = collect(head, again, 4, raw=True)
    assert got == greedy_reference(tiny_store, [again], 4, raw=True)[again]
    assert deltas(before, counters(head)) == [(d.prompt_tokens, 0, 0)] * 3  # prefilled, nothing read from disk
