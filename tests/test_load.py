"""16 concurrent clients on a 3-node ring: every answer equals its own reference, and afterwards no
node holds a KV cache more than when idle."""

import asyncio
import time

import pytest

from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from prima_rpc.app import ring
from prima_rpc.client import PrimaClient, Token

pytestmark = pytest.mark.slow
TOPICS = ["the sea", "a cat", "winter", "a robot", "bread", "the moon", "trains", "music", "rain", "a forest",
          "chess", "coffee", "a river", "snow", "bees", "a clock"]
PROMPTS = [f"Write one sentence about {t}." for t in TOPICS]
TOKENS = 8


def test_sixteen_concurrent_clients(rings, smol_store):
    local = rings(3)
    ring.start(local.addresses[0], [10, 10, 10])
    idle = {a: i.stats for a, i in ring.walk(local.addresses[0])}
    model = ReferenceModel(smol_store)
    expected = [[t.token_id for t in model.generate(p, GenerateParams(max_tokens=TOKENS))] for p in PROMPTS]

    async def one(prompt):
        async with PrimaClient(local.addresses[0]) as client:
            return [e.token_id async for e in client.generate(prompt, max_tokens=TOKENS) if isinstance(e, Token)]

    async def everyone():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(everyone()) == expected
    # Each request's RELEASE frame goes once round the ring after its last token reached the client: wait for
    # it (bounded) rather than read the nodes the instant the answers are in.
    deadline = time.monotonic() + 10
    while True:
        after = {a: i.stats for a, i in ring.walk(local.addresses[0])}
        if all(s.active_requests == 0 for s in after.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for address, stats in after.items():
        assert stats.active_requests == 0, f"{address} still holds KV caches"
        assert stats.resident_bytes == idle[address].resident_bytes, f"{address}: memory not back to idle"
        assert stats.rss_bytes < idle[address].rss_bytes + (256 << 20), f"{address}: RSS grew by >256 MiB"
