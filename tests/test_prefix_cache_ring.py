"""The prefix cache on real 3-node rings: a chat's second turn after a long system prompt prefills only its new
tokens and gives the same tokens as a cold run (SmolLM2); on the tiny synthetic model (512 positions of KV room a
node), eviction, a node that lost its prefixes, a re-plan and n = 3 choices of one prompt."""

import pytest

from prima_rpc.app import ring
from prima_rpc.control import Control, assign_request
from tests.rings import collect, collect_all, greedy_reference

pytestmark = pytest.mark.slow


def counters(head: str) -> list[tuple[int, int, int]]:
    """Each node's (prefilled tokens, prefix hit tokens, cached positions), in ring order from the head."""
    return [(i.stats.prefilled_tokens, i.stats.prefix_hit_tokens, i.stats.prefix_cached_tokens)
            for _, i in ring.walk(head)]


def deltas(before, after) -> list[tuple[int, int]]:
    """Each node's (prefilled, hit) tokens between two counters() readings."""
    return [(a[0] - b[0], a[1] - b[1]) for b, a in zip(before, after, strict=True)]


SYSTEM = "You are a careful assistant for a home cluster. These are the house rules, read them all.\n" + "".join(
    f"Rule {i}: when the user asks about device number {i}, answer with its room, its owner and its last backup "
    f"date, and never invent a value you were not given.\n" for i in range(40))


def test_second_chat_turn_prefills_only_its_new_tokens(rings, smol_store):
    head = rings(3, [10, 10, 10]).addresses[0]
    turn1 = SYSTEM + "User: Which rule covers device 7?\nAssistant:"
    turn2 = turn1 + " Rule 7.\nUser: And who owns it?\nAssistant:"
    first, done1 = collect(head, turn1, 8, raw=True)
    assert done1.prompt_tokens >= 1400  # the long system prompt
    before = counters(head)
    second, done2 = collect(head, turn2, 12, raw=True)
    assert second == greedy_reference(smol_store, [turn2], 12, raw=True)[turn2]  # the cold run's tokens
    for prefilled, hit in deltas(before, counters(head)):
        assert hit >= done1.prompt_tokens - 128 and prefilled == done2.prompt_tokens - hit
        assert prefilled < done2.prompt_tokens - done1.prompt_tokens + 128


@pytest.fixture(scope="module")
def tiny_ring(tiny_rings):
    # a budget below the minimum runs at it: the KV room is the context, 512 positions a node; the prefixes in memory
    # alone (their copies on disk: tests/test_prefix_disk_ring.py)
    return tiny_rings(3, [3, 3, 2], extra_args=[["--mem-budget", "1", "--prefix-disk", "0"]] * 3).addresses[0]


def words(n: int, seed: int) -> str:
    return " ".join(f"w{(i * 7919 + seed) % 97}" for i in range(n))


def test_a_hit_gives_the_cold_tokens_and_counts_only_the_rest(tiny_ring, tiny_store):
    p1 = words(40, 1)  # about 160 tokens (a word is about 4)
    p2 = p1 + " " + words(20, 2)
    _, d1 = collect(tiny_ring, p1, 4, raw=True)
    before = counters(tiny_ring)
    got, d2 = collect(tiny_ring, p2, 6, raw=True)
    assert got == greedy_reference(tiny_store, [p2], 6, raw=True)[p2]
    cached = d1.prompt_tokens // 64 * 64
    assert deltas(before, counters(tiny_ring)) == [(d2.prompt_tokens - cached, cached)] * 3


def test_eviction_under_a_small_kv_room_falls_back_to_a_cold_prefill(tiny_ring, tiny_store):
    p1, big = words(40, 3), words(100, 4)  # about 160 and 390 tokens, of the 512 positions a node holds
    collect(tiny_ring, p1, 4, raw=True)
    assert all(cached >= 128 for _, _, cached in counters(tiny_ring))
    collect(tiny_ring, big, 5, raw=True)  # its KV leaves too little room for p1's prefix (nor its own)
    assert all(cached == 0 for _, _, cached in counters(tiny_ring))
    before = counters(tiny_ring)
    p2 = p1 + " " + words(10, 5)
    got, d2 = collect(tiny_ring, p2, 5, raw=True)
    assert got == greedy_reference(tiny_store, [p2], 5, raw=True)[p2]
    assert deltas(before, counters(tiny_ring)) == [(d2.prompt_tokens, 0)] * 3


def test_a_node_that_lost_its_prefixes_makes_the_head_prefill_from_0(tiny_ring, tiny_store):
    p1 = words(40, 6)
    collect(tiny_ring, p1, 4, raw=True)
    (_, head), (worker, info), _ = ring.walk(tiny_ring)
    with Control(worker) as peer:  # the worker reloads its windows behind the head's back (as after a restart)
        for _ in peer.assign(assign_request([(r.start, r.stop) for r in info.windows], info.n_layers, info.model_id,
                                            info.epoch, replan=True, ring=list(head.ring), head_address=tiny_ring)):
            pass
    assert counters(tiny_ring)[1][2] == 0
    p2 = p1 + " " + words(8, 7)
    before = counters(tiny_ring)
    got, d2 = collect(tiny_ring, p2, 5, raw=True)
    assert got == greedy_reference(tiny_store, [p2], 5, raw=True)[p2]
    after = counters(tiny_ring)
    assert [d[0] for d in deltas(before, after)][1:] == [d2.prompt_tokens] * 2  # all prefilled again
    assert deltas(before, after)[1][1] == 0
    before = counters(tiny_ring)  # the full prefill kept p2's prefix everywhere again
    collect(tiny_ring, p2 + " more", 3, raw=True)
    assert all(hit > 0 for _, hit in deltas(before, counters(tiny_ring)))


def test_three_choices_of_one_prompt_prefill_it_once(tiny_ring, tiny_store):
    prompt = words(25, 8)  # about 100 tokens: three requests and the prefix fit the 512 positions
    before = counters(tiny_ring)
    results = collect_all(tiny_ring, [prompt] * 3, 5, raw=True)
    n = results[0][1].prompt_tokens
    assert all(tokens == greedy_reference(tiny_store, [prompt], 5, raw=True)[prompt] for tokens, _ in results)
    shared = (n - 1) // 64 * 64  # the two others take all but the prompt's last (partial) block
    assert shared > 0
    assert deltas(before, counters(tiny_ring)) == [(n + 2 * (n - shared), 2 * shared)] * 3


def test_a_replan_drops_every_cached_prefix(tiny_ring):
    p1 = words(40, 9)
    collect(tiny_ring, p1, 3, raw=True)
    assert all(cached > 0 for _, _, cached in counters(tiny_ring))
    ring.start(tiny_ring, [3, 3, 2])
    assert all(cached == 0 for _, _, cached in counters(tiny_ring))
    before = counters(tiny_ring)
    collect(tiny_ring, p1 + " again", 3, raw=True)
    assert all(hit == 0 for _, hit in deltas(before, counters(tiny_ring)))
