"""16 concurrent clients on a 3-node ring: every answer equals its own reference, and afterwards no
node holds a KV cache more than when idle."""

import pytest

from prima_rpc.app import ring
from tests.rings import collect_all, greedy_reference, released

pytestmark = pytest.mark.slow
TOPICS = ["the sea", "a cat", "winter", "a robot", "bread", "the moon", "trains", "music", "rain", "a forest",
          "chess", "coffee", "a river", "snow", "bees", "a clock"]
PROMPTS = [f"Write one sentence about {t}." for t in TOPICS]
TOKENS = 8


def test_sixteen_concurrent_clients(rings, smol_store):
    local = rings(3, [10, 10, 10])
    idle = {a: i.stats for a, i in ring.walk(local.addresses[0])}
    expected = greedy_reference(smol_store, PROMPTS, TOKENS)
    assert [tokens for tokens, _ in collect_all(local.addresses[0], PROMPTS, TOKENS)] == [expected[p] for p in PROMPTS]
    # Each request's RELEASE frame goes once round the ring after its last token reached the client: wait for
    # it (bounded) rather than read the nodes the instant the answers are in.
    released(local.addresses[0])
    after = {a: i.stats for a, i in ring.walk(local.addresses[0])}
    for address, stats in after.items():
        assert stats.active_requests == 0, f"{address} still holds KV caches"
        assert stats.resident_bytes == idle[address].resident_bytes, f"{address}: memory not back to idle"
        assert stats.rss_bytes < idle[address].rss_bytes + (256 << 20), f"{address}: RSS grew by >256 MiB"
