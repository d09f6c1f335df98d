"""Speculative windows in flight (nodes/ring/inflight.py) across real rings: several verify windows of one request
go round at once; a rejection cancels the later ones. Greedy tokens equal plain single-process decoding, and a
seeded sampled request gives the very tokens it gives without speculation, for k = 1, k = 2, a relay and a node
that streams its layers from disk."""

import grpc
import pytest

from prima_rpc.app import ring
from prima_rpc.client import PrimaError
from tests.rings import collect, greedy_reference, local_ring, released

pytestmark = pytest.mark.slow
REPEAT = ("Repeat this text exactly: the quick brown fox jumps over the lazy dog while the cat sleeps on the "
          "warm mat by the door.")
PROMPTS = ["Write a haiku about autumn.", "List three prime numbers.", REPEAT]
TOKENS = 24
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def reference(smol_store):
    return greedy_reference(smol_store, PROMPTS, TOKENS)


def check_ring(address: str, reference: dict, speculate: str = "ngram") -> None:
    drafted = accepted = trips = tokens_out = 0
    for prompt in PROMPTS:
        tokens, done = collect(address, prompt, TOKENS, speculate=speculate, draft_tokens=4, depth=4)
        assert tokens == reference[prompt], prompt
        assert done.depth == 4 and done.accepted <= done.drafted
        drafted, accepted, trips, tokens_out = (drafted + done.drafted, accepted + done.accepted,
                                                trips + done.trips, tokens_out + len(tokens))
    assert 0 < accepted < drafted  # windows were verified, accepted and rejected (later windows cancelled)
    assert trips < tokens_out  # some trips yielded more than one token
    plain, off = collect(address, REPEAT, TOKENS, speculate="off", **SAMPLED)
    fast, on = collect(address, REPEAT, TOKENS, speculate=speculate, depth=4, **SAMPLED)
    assert fast == plain and on.drafted > 0 and off.drafted == 0 and off.trips == len(plain)
    assert released(address)


@pytest.mark.parametrize("windows", [[10, 10, 10], [7, 3, 5]], ids=["k=1", "k=2"])
def test_windows_in_flight_equal_plain_decoding(rings, reference, windows):
    check_ring(rings(3, windows).addresses[0], reference)


def test_windows_in_flight_through_a_relay(rings, reference):
    check_ring(rings(4, [10, 10, 0, 10]).addresses[0], reference)


def test_windows_in_flight_through_a_streaming_node(smol_store, reference, tmp_path):
    with local_ring(smol_store, 3, tmp_path, [10, 10, 10], extra_args=[[], ["--mem-budget", "1"], []]) as local:
        infos = [info for _, info in ring.walk(local.addresses[0])]
        assert infos[1].stats.resident_bytes < infos[1].mem_budget  # it streams its layers from disk
        check_ring(local.addresses[0], reference)


def test_windows_in_flight_from_a_draft_model(smol_store, reference, tmp_path):
    """The target's own store as the head's draft: greedy chains are accepted whole, window after window."""
    with local_ring(smol_store, 2, tmp_path, [15, 15], extra_args=[["--draft", str(smol_store)], []]) as local:
        tokens, done = collect(local.addresses[0], PROMPTS[0], TOKENS, speculate="draft", draft_tokens=4, depth=3)
        assert tokens == reference[PROMPTS[0]]
        assert done.accepted == done.drafted > 0 and done.trips <= TOKENS // 3
        plain = collect(local.addresses[0], PROMPTS[1], TOKENS, speculate="off", **SAMPLED)[0]
        fast, on = collect(local.addresses[0], PROMPTS[1], TOKENS, speculate="draft", depth=3, **SAMPLED)
        assert fast == plain and on.accepted < on.drafted  # sampled: some rejections, later windows cancelled


def test_a_relay_drafts_for_the_head(smol_store, tiny_store, reference, tmp_path):
    """prima-node --draft DIR on a relay (no layers): the head asks it for every window's drafts."""
    extra = [[], ["--draft", str(smol_store)], []]
    with local_ring(smol_store, 3, tmp_path / "ok", [15, 0, 15], extra_args=extra) as local:
        assert [info.draft for _, info in ring.walk(local.addresses[0])] == [False, True, False]
        tokens, done = collect(local.addresses[0], PROMPTS[0], TOKENS, speculate="draft", draft_tokens=4, depth=3)
        assert tokens == reference[PROMPTS[0]] and done.accepted == done.drafted > 0 and done.depth == 3
        tokens, done = collect(local.addresses[0], PROMPTS[1], TOKENS, speculate="draft", depth=1)
        assert tokens == reference[PROMPTS[1]] and done.accepted == done.drafted > 0  # one window at a time too
        tokens, done = collect(local.addresses[0], PROMPTS[2], TOKENS)  # the head's default: the relay's draft
        assert tokens == reference[PROMPTS[2]] and done.accepted == done.drafted > 0
    with local_ring(smol_store, 3, tmp_path / "bad", [15, 0, 15], extra_args=[[], ["--draft", str(tiny_store)], []]) \
            as local:
        with pytest.raises(PrimaError, match="does not share the target's tokenizer") as err:
            collect(local.addresses[0], PROMPTS[0], TOKENS, speculate="draft", depth=2)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
