"""What the chaos soak found, each a case on a real ring (prima-node processes on loopback): a node that lost a
request's KV cache between admitting a frame and computing it (a stray RELEASE here; a re-plan racing a long prompt
in the soak) makes the head replay the request, whose answer still equals the reference, where it used to fail
with INVALID_ARGUMENT; a node that joined after the last assignment, left out by the standby's take-over, joins the
new head's ring; a node re-planned again and again gives its old windows' memory back."""

import asyncio

import pytest

from nodes.ring import frames
from prima_rpc.app import ring
from prima_rpc.client import PrimaClient, Token
from prima_rpc.control import Control
from tests.rings import collect, greedy_tokens, local_ring, send_frames
from tests.test_failover import wait_for
from tests.test_join import joiner
from tools.bench.chaos_ring import anon_rss

pytestmark = pytest.mark.slow


async def stream_dropping_caches(head: str, epoch: int, prompt: str, max_tokens: int, after: int):
    """One request's tokens, a RELEASE of it sent to the head once `after` tokens are in: the head frees its own KV
    cache of the request (the frames it admitted meet none when they are computed)."""
    tokens, done = [], None
    async with PrimaClient(head) as client:
        async for event in client.generate(prompt, max_tokens=max_tokens, raw=True, request_id="dropped"):
            if isinstance(event, Token):
                tokens.append(event.token_id)
                if len(tokens) == after:
                    assert await send_frames(head, frames.release("dropped", epoch)) is None
            else:
                done = event
    return tokens, done


def test_a_node_that_lost_a_requests_kv_cache_mid_stream_makes_the_head_replay_it(tiny_store, tmp_path):
    expected = greedy_tokens(tiny_store, "hello", 40, raw=True)
    with local_ring(tiny_store, 2, tmp_path, windows=[4, 4]) as local:
        head = local.addresses[0]
        epoch = ring.walk(head)[0][1].epoch
        tokens, done = asyncio.run(stream_dropping_caches(head, epoch, "hello", 40, after=5))
        assert tokens == expected and done.finish_reason == "length"
        text = (tmp_path / "node0.log").read_text()
        assert "replaying" in text


def test_a_node_that_joined_after_the_last_assignment_follows_the_new_head_after_a_failover(tiny_store, tmp_path):
    # the soak's finding: a joined relay is in no member's ring list (the head told only it), so the standby took
    # over and routed around it; the relay followed the dead head for good, outside the ring
    expected = greedy_tokens(tiny_store, "hello", 8, raw=True)
    with local_ring(tiny_store, 3, tmp_path, windows=[4, 2, 2]) as local:
        head, standby, worker = local.addresses
        proc, new = joiner(worker, tmp_path / "joiner.log", "--cache", str(tmp_path / "cache"))
        try:
            wait_for(lambda: [a for a, _, _ in ring.status(head)], lambda a: new in a, 60, "the join")
            local.processes[0].kill()
            rows = wait_for(lambda: ring.status(standby), lambda r: (new, "joined") in [(a, s) for a, s, _ in r],
                            60, "the joined node in the new head's ring")
            assert rows[0][0] == standby
            assert ring.walk(standby)[0][1].role == "head"
            assert info(new).head == standby
            assert collect(standby, "hello", 8, raw=True)[0] == expected
        finally:
            proc.terminate()
            proc.wait(15)


def info(address: str):
    with Control(address) as peer:
        return peer.info()


def anon_beyond_weights(address: str, pid: int) -> int:
    return anon_rss(pid) - info(address).stats.resident_bytes


def test_a_node_re_planned_again_and_again_gives_the_old_windows_memory_back(smol_store, tmp_path):
    # the soak's finding: anonymous RSS beyond the weights grew ~1 GiB on a node re-planned 4-5 times (glibc kept
    # the old windows' memory in the compute thread's arena); now trimmed after each load
    with local_ring(smol_store, 2, tmp_path, windows=[15, 15]) as local:
        worker, pid = local.addresses[1], local.processes[1].pid
        start = anon_rss(pid)
        before = anon_beyond_weights(worker, pid)
        for windows in ([10, 20], [20, 10], [5, 25], [25, 5], [15, 15]):
            ring.start(local.addresses[0], windows)
        grown = anon_beyond_weights(worker, pid) - before
        assert grown < 0.10 * start, f"{grown / 2**20:.0f} MiB more beyond the weights (started at {start / 2**20:.0f})"
