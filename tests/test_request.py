"""GenerateRequest: each range checked once, naming its field, and one conversion to the wire and back."""

import pytest

from prima_rpc.request import GenerateRequest, Message, RequestError
from prima_rpc.v1 import prima_pb2 as pb


@pytest.mark.parametrize("fields, field, message", [
    (dict(max_tokens=0), "max_tokens", "max_tokens must be in [1, 2147483647], got 0"),
    (dict(max_tokens=2**31), "max_tokens", "max_tokens must be in [1, 2147483647]"),
    (dict(max_tokens=2.5), "max_tokens", "max_tokens must be in [1,"),
    (dict(temperature=2.01), "temperature", "temperature must be in [0, 2], got 2.01"),
    (dict(temperature=float("nan")), "temperature", "temperature must be in [0, 2]"),
    (dict(temperature=True), "temperature", "temperature must be in [0, 2]"),
    (dict(top_k=-1), "top_k", "top_k must be in [0, 2147483647], got -1"),
    (dict(top_p=1.5), "top_p", "top_p must be in [0, 1], got 1.5"),
    (dict(seed=-1), "seed", "seed must be in [0, 2**64 - 1], got -1"),
    (dict(seed=2**64), "seed", "seed must be in [0, 2**64 - 1]"),
    (dict(stop=("a",) * 17), "stop", "up to 16 non-empty strings, got 17"),
    (dict(stop=["a", ""]), "stop", "non-empty"),
    (dict(stop=("a", "\udce9")), "stop[1]", "a stop string is not valid UTF-8 text (byte 0xe9 at character 0)"),
    (dict(prompt="caf\udce9"), "prompt", "the prompt is not valid UTF-8 text (byte 0xe9 at character 3)"),
    (dict(messages=[Message("user", "ok"), Message("user", "\udcff")]), "messages[1]", "a message is not valid"),
    (dict(speculate="magic"), "speculate", "speculate must be one of off, ngram, draft, got 'magic'"),
    (dict(draft_tokens=17), "draft_tokens", "draft_tokens must be in [1, 16], got 17"),
    (dict(chat_template_kwargs="[1]"), "chat_template_kwargs", "a JSON object is expected"),
    (dict(chat_template_kwargs="{"), "chat_template_kwargs", "not JSON"),
    (dict(chat_template_kwargs='{"messages": []}'), "chat_template_kwargs", "'messages' is not a variable"),
    (dict(chat_template_kwargs='{"a b": 1}'), "chat_template_kwargs", "'a b' is not a variable"),
    (dict(chat_template_kwargs='{"x": "%s"}' % ("y" * 4096)), "chat_template_kwargs", "at most 4096 characters"),
    (dict(chat_template_kwargs='{"enable_thinking": false}', raw=True), "chat_template_kwargs", "a raw prompt"),
])
def test_a_field_out_of_range_is_named(fields, field, message):
    with pytest.raises(RequestError) as err:
        GenerateRequest(**{"prompt": "hi", **fields})
    assert err.value.field == field and message in str(err.value)


def test_the_defaults_are_the_heads():
    wire = GenerateRequest().to_wire()
    assert (wire.speculate, wire.draft_tokens, wire.top_k, wire.request_id) == ("", 0, 0, "")
    assert not wire.HasField("seed") and wire.top_p == 1.0 and wire.max_tokens == 128


@pytest.mark.parametrize("request_", [
    GenerateRequest("hi"),
    GenerateRequest(messages=(Message("system", "Be brief."), Message("user", "a\nb")), max_tokens=5,
                    temperature=0.5, top_k=40, top_p=0.75, seed=2**64 - 1, stop=("\n", "END"), speculate="ngram",
                    draft_tokens=3, request_id="r1", chat_template_kwargs='{"enable_thinking": false}'),
    GenerateRequest("raw text", raw=True, seed=0, speculate="off"),
])
def test_the_wire_round_trip_is_exact(request_):
    wire = pb.GenerateRequest.FromString(request_.to_wire().SerializeToString())
    assert GenerateRequest.from_wire(wire) == request_


def test_the_wire_reads_top_p_0_as_off_and_refuses_what_the_head_would():
    assert GenerateRequest.from_wire(pb.GenerateRequest(max_tokens=4, top_p=0.0)).top_p == 1.0
    with pytest.raises(RequestError, match="max_tokens"):
        GenerateRequest.from_wire(pb.GenerateRequest(max_tokens=-3))


def test_lists_given_become_tuples():
    request = GenerateRequest("hi", stop=["a"], messages=[Message("user", "x")])
    assert request.stop == ("a",) and request.messages == (Message("user", "x"),)
    hash(request)
