"""Speculation across real rings: one multi-position frame per trip verifies the draft on every node; greedy
tokens equal plain single-process decoding for k = 1, k = 2 and under budgets that stream."""

import grpc
import pytest

from prima_rpc.app import ring
from prima_rpc.client import PrimaError
from tests.rings import collect, greedy_reference, local_ring

pytestmark = pytest.mark.slow
REPEAT = ("Repeat this text exactly: the quick brown fox jumps over the lazy dog while the cat sleeps on the "
          "warm mat by the door.")
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "List three prime numbers.", REPEAT]
TOKENS = 24


@pytest.fixture(scope="module")
def reference(smol_store):
    return greedy_reference(smol_store, PROMPTS, TOKENS)


def check_ring(address: str, reference: dict) -> None:
    drafted = accepted = 0
    for prompt in PROMPTS:
        tokens, done = collect(address, prompt, TOKENS, speculate="ngram", draft_tokens=6)
        assert tokens == reference[prompt], prompt
        assert done.completion_tokens == len(tokens) and done.accepted <= done.drafted
        drafted, accepted = drafted + done.drafted, accepted + done.accepted
    assert 0 < accepted < drafted  # verification frames ran, and both acceptance and rejection happened
    plain = collect(address, REPEAT, TOKENS, speculate="off")[1]
    assert plain.drafted == plain.accepted == 0
    assert all(info.stats.active_requests == 0 for _, info in ring.walk(address))


@pytest.mark.parametrize("windows", [[10, 10, 10], [7, 3, 5]], ids=["k=1", "k=2"])
def test_speculating_ring_equals_plain_decoding(rings, reference, windows):
    check_ring(rings(3, windows).addresses[0], reference)


def test_speculating_ring_under_streaming_budgets(smol_store, reference, tmp_path):
    with local_ring(smol_store, 3, tmp_path, [10, 10, 10], extra_args=[["--mem-budget", "1"]] * 3) as local:
        assert all(info.stats.resident_bytes < info.mem_budget for _, info in ring.walk(local.addresses[0]))
        check_ring(local.addresses[0], reference)


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculate="magic"), "speculate must be one of"),
    (dict(speculate="ngram", draft_tokens=17), "draft_tokens must be in"),
    (dict(speculate="draft"), "needs a draft model"),
])
def test_bad_speculation_settings_are_refused(rings, kwargs, message):
    local = rings(3, [10, 10, 10])
    with pytest.raises(PrimaError, match=message) as err:
        collect(local.addresses[0], "Hi", TOKENS, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_head_with_a_draft_model(smol_store, reference, tmp_path):
    """prima-node --draft DIR on the head (here the target's own store, so drafts are mostly accepted)."""
    with local_ring(smol_store, 3, tmp_path, [10, 10, 10], extra_args=[["--draft", str(smol_store)], [], []]) as local:
        for prompt in PROMPTS[:2]:
            tokens, done = collect(local.addresses[0], prompt, TOKENS, speculate="draft", draft_tokens=4)
            assert tokens == reference[prompt], prompt
            assert done.accepted >= 0.5 * done.drafted > 0


def test_a_draft_of_another_tokenizer_fails_the_request_not_the_node(smol_store, tiny_store, tmp_path):
    with local_ring(smol_store, 1, tmp_path, [30], extra_args=[["--draft", str(tiny_store)]]) as local:
        with pytest.raises(PrimaError, match="synthetic-tiny .* does not share the tokenizer of") as err:
            collect(local.addresses[0], PROMPTS[0], TOKENS, speculate="draft")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        tokens, _ = collect(local.addresses[0], PROMPTS[0], TOKENS, speculate="ngram")
        assert tokens  # the node stays up and serves
