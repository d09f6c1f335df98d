"""What the chaos soak found, each a case on a real ring (prima-node processes on loopback): a node that lost a
request's KV cache between admitting a frame and computing it (a stray RELEASE here; a re-plan racing a long prompt
in the soak) makes the head replay the request, whose answer still equals the reference, where it used to fail
with INVALID_ARGUMENT."""

import asyncio

import pytest

from nodes.ring import frames
from prima_rpc.app import ring
from prima_rpc.client import PrimaClient, Token
from tests.rings import greedy_tokens, local_ring, send_frames

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
