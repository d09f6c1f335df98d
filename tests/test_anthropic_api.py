"""Anthropic's Messages API: bodies onto the one GenerateRequest by table, and the official `anthropic` client on a
real 3-node ring behind the HTTP API (a streamed message, a tool-use round trip, its input streamed in pieces)."""

import asyncio
import json

import anthropic
import jsonschema
import pytest

from prima_rpc.app.anthropic_request import parse_messages
from prima_rpc.app.openai_request import ApiError
from prima_rpc.request import Message, Tool, ToolCall
from tests.test_openai_api import api_server, grpc_text, post

SYSTEM = "You are brief."
ASK = "What is the capital of France?"
WEATHER = {"name": "get_weather", "description": "The weather now in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                            "required": ["city"], "additionalProperties": False}}
BASE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": ASK}]}


def test_a_body_becomes_the_one_request():
    call = parse_messages({**BASE, "system": [{"type": "text", "text": SYSTEM}], "temperature": 0.5, "top_k": 3,
                           "stop_sequences": ["."], "stream": True, "tools": [WEATHER],
                           "tool_choice": {"type": "tool", "name": "get_weather"}})
    r = call.request
    assert call.stream and call.model == "m"
    assert r.messages == (Message("system", SYSTEM), Message("user", ASK))
    assert (r.max_tokens, r.temperature, r.top_k, r.stop, r.tool_choice) == (8, 0.5, 3, (".",), "get_weather")
    assert r.tools == (Tool("get_weather", WEATHER["description"], json.dumps(WEATHER["input_schema"])),)
    assert parse_messages({**BASE, "tools": [WEATHER], "tool_choice": {"type": "any"}}).request.tool_choice == \
        "required"


def test_tool_use_and_results_become_calls_and_tool_messages():
    turns = [{"role": "user", "content": ASK},
             {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                          {"type": "text", "text": "And so?"}]}]
    r = parse_messages({**BASE, "messages": turns, "tools": [WEATHER]}).request
    assert r.messages[1:] == (
        Message("assistant", "Let me look.", (ToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),)),
        Message("tool", "sunny", (), "toolu_1", "get_weather"), Message("user", "And so?"))


@pytest.mark.parametrize("change, param", [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": 3}, "temperature"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"stop_sequences": [""]}, "stop_sequences"), ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tools": [{"name": "x", "input_schema": []}]}, "tools.0"), ({"thinking": {"type": "enabled"}}, "thinking"),
    ({"model": None}, "model"),
])
def test_bad_bodies_name_the_parameter(change, param):
    with pytest.raises(ApiError) as err:
        parse_messages({k: v for k, v in {**BASE, **change}.items() if v is not None})
    assert err.value.status == 400 and err.value.param == param and param.split(".")[0] in err.value.message


def test_errors_have_anthropics_shape_without_a_ring():
    with api_server("127.0.0.1:1") as url:  # no head there: validation answers first
        status, body = post(url + "/messages", json.dumps({**BASE, "max_tokens": "x"}).encode())
        assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in body["error"]["message"]
        status, body = post(url + "/messages", json.dumps(BASE).encode())
        assert status == 503 and body["error"]["type"] == "overloaded_error" and "127.0.0.1:1" in \
            body["error"]["message"]


def test_the_token_goes_as_x_api_key_too():
    with api_server("127.0.0.1:1", token="s3cret") as url:
        data = json.dumps(BASE).encode()
        status, body = post(url + "/messages", data, {"x-api-key": "wrong"})
        assert status == 401 and body["error"]["type"] == "authentication_error" and "x-api-key" in \
            body["error"]["message"]
        assert post(url + "/messages", data, {"x-api-key": "s3cret"})[0] == 503  # past the key: no head there
        assert post(url + "/messages", data, {"Authorization": "Bearer s3cret"})[0] == 503


# ---------------------------------------------------------------- a real 3-node ring


@pytest.fixture(scope="module")
def head(rings) -> str:
    return rings(3, [10, 10, 10]).addresses[0]


@pytest.fixture(scope="module")
def client(head):
    with api_server(head) as url:
        yield anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_streamed_message_equals_whole_and_the_grpc_client(client, head):
    kw = dict(model="m", max_tokens=10, system=SYSTEM, messages=[{"role": "user", "content": ASK}],
              extra_body={"temperature": 0})  # greedy (this client takes no temperature of its own)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    expected, done = asyncio.run(grpc_text(head, messages=[{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": ASK}]))
    assert whole.content[0].text == final.content[0].text == expected
    assert whole.stop_reason == final.stop_reason == "max_tokens" and whole.usage.output_tokens == 10
    assert whole.usage.input_tokens == final.usage.input_tokens == done.prompt_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(client, stream):
    turns = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="m", max_tokens=48, tools=[WEATHER], tool_choice={"type": "any"}, extra_body={"temperature": 0})
    if stream:
        with client.messages.stream(messages=turns, **kw) as s:
            events = list(s)
            reply = s.get_final_message()
        pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        assert len(pieces) > 1 and not [e for e in events if e.type == "content_block_delta"
                                        and e.delta.type == "text_delta"]  # the call streams, never as text
        starts = [e for e in events if e.type == "content_block_start"]
        assert [b.content_block.type for b in starts] == ["tool_use"] and starts[0].content_block.name
        assert json.loads("".join(pieces)) == reply.content[-1].input
    else:
        reply = client.messages.create(messages=turns, **kw)
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    turns += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}]}]
    answer = client.messages.create(messages=turns, model="m", max_tokens=16, tools=[WEATHER],
                                    extra_body={"temperature": 0})
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text
