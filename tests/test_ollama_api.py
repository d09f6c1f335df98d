"""Ollama's API: bodies onto the one GenerateRequest by table, and the official `ollama` client on a real 3-node ring
behind the HTTP API (chat, generate, list, show)."""

import asyncio
import json
import urllib.error
import urllib.request

import ollama
import pytest

from prima_rpc.app.ollama_request import parse_ollama
from prima_rpc.app.openai_request import ApiError
from prima_rpc.control import AioControl
from prima_rpc.request import Message, ToolCall
from tests.test_openai_api import RAW, TOKENS, api_server, grpc_text, post

SYSTEM = "You are brief."
ASK = "What is the capital of France?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
BASE = {"model": "m", "messages": CHAT}


def test_a_chat_body_becomes_the_one_request():
    call = parse_ollama({**BASE, "format": "json", "options": {"temperature": 0.7, "num_predict": 9, "seed": -1,
                                                               "stop": "\n", "repeat_penalty": 1.1, "num_ctx": 4096}},
                        chat=True, default_max_tokens=100)
    r = call.request
    assert call.stream and call.model == "m"  # Ollama streams unless told not to
    assert r.messages == (Message("system", SYSTEM), Message("user", ASK))
    assert (r.temperature, r.max_tokens, r.seed, r.stop, r.repetition_penalty, r.response_format) == \
        (0.7, 9, 2**64 - 1, ("\n",), 1.1, "json_object")
    assert parse_ollama({**BASE, "options": {"num_predict": -1}}, True, 100).request.max_tokens == 100
    assert parse_ollama({**BASE, "stream": False, "messages": []}, True, 100).request is None  # only loads


def test_tool_messages_answer_their_calls_in_order():
    turns = [{"role": "user", "content": ASK},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": {}}}]},
             {"role": "tool", "content": "one"}, {"role": "tool", "content": "two", "tool_name": "b"}]
    r = parse_ollama({"model": "m", "messages": turns}, True, 10).request
    assert r.messages[1].tool_calls == (ToolCall("call_1_0", "a", '{"x": 1}'), ToolCall("call_1_1", "b", "{}"))
    assert r.messages[2:] == (Message("tool", "one", (), "call_1_0", "a"), Message("tool", "two", (), "call_1_1", "b"))


def test_think_is_the_templates_enable_thinking():
    assert parse_ollama({**BASE, "think": False}, True, 10).request.template_kwargs() == {"enable_thinking": False}
    assert parse_ollama({"model": "m", "prompt": ASK, "think": True}, False, 10).request.template_kwargs() == {
        "enable_thinking": True}
    raw = parse_ollama({"model": "m", "prompt": RAW, "raw": True, "think": True}, False, 10).request
    assert raw.template_kwargs() == {}  # a raw prompt has no template to switch


def test_a_generate_body_is_templated_unless_raw():
    r = parse_ollama({"model": "m", "prompt": ASK, "system": SYSTEM}, False, 10).request
    assert r.messages == (Message("system", SYSTEM), Message("user", ASK)) and not r.raw
    r = parse_ollama({"model": "m", "prompt": RAW, "raw": True}, False, 10).request
    assert (r.prompt, r.raw) == (RAW, True)


@pytest.mark.parametrize("chat, change, param", [
    (True, {"model": ""}, "model"), (True, {"stream": "yes"}, "stream"),
    (True, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (True, {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
    (True, {"options": {"temperature": "hot"}}, "options.temperature"),
    (True, {"options": {"top_k": 1.5}}, "options.top_k"), (True, {"options": {"temperature": 5}}, "temperature"),
    (True, {"format": "yaml"}, "format"), (False, {"prompt": "x", "context": [1, 2]}, "context"),
    (True, {"think": "high"}, "think"),
])
def test_bad_bodies_name_the_parameter(chat, change, param):
    with pytest.raises(ApiError) as err:
        parse_ollama({**BASE, **change}, chat, 10)
    assert err.value.status == 400 and err.value.param == param and param.split("[")[0] in err.value.message


def test_errors_have_ollamas_shape_without_a_ring():
    with api_server("127.0.0.1:1") as url:  # no head there: validation answers first
        base = url.removesuffix("/v1")
        status, body = post(base + "/api/chat", json.dumps({**BASE, "options": {"top_p": 7}}).encode())
        assert status == 400 and set(body) == {"error"} and "top_p" in body["error"]
        status, body = post(base + "/api/generate", json.dumps({"model": "m", "prompt": "hi"}).encode())
        assert status == 503 and "127.0.0.1:1" in body["error"]
        with pytest.raises(urllib.error.HTTPError) as err:  # GET: not allowed, in Ollama's shape
            urllib.request.urlopen(base + "/api/chat", timeout=30)
        assert err.value.code == 405 and set(json.loads(err.value.read())) == {"error"}
        status, body = post(base + "/api/ring-nope", b"{}")  # beside the page's /api/ring: OpenAI's shape
        assert status == 404 and body["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- a real 3-node ring


@pytest.fixture(scope="module")
def head(rings) -> str:
    return rings(3, [10, 10, 10]).addresses[0]


@pytest.fixture(scope="module")
def client(head):
    with api_server(head) as url:
        yield ollama.Client(host=url.removesuffix("/v1"), timeout=120)


@pytest.mark.slow
def test_chat_streamed_and_whole_equal_the_grpc_client(client, head):
    options = {"num_predict": TOKENS, "temperature": 0}
    whole = client.chat(model="m", messages=CHAT, stream=False, options=options)
    parts = list(client.chat(model="m", messages=CHAT, stream=True, options=options))
    expected, done = asyncio.run(grpc_text(head, messages=CHAT))
    assert whole.message.content == "".join(p.message.content for p in parts) == expected
    assert whole.done and whole.done_reason == "length" and whole.eval_count == TOKENS
    assert whole.prompt_eval_count == done.prompt_tokens
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]


@pytest.mark.slow
def test_generate_raw_and_templated(client, head):
    greedy = {"num_predict": TOKENS, "temperature": 0}
    raw = client.generate(model="m", prompt=RAW, raw=True, options=greedy)
    assert raw.response == asyncio.run(grpc_text(head, RAW, raw=True))[0] and raw.done
    parts = list(client.generate(model="m", prompt=ASK, system=SYSTEM, stream=True, options=greedy))
    assert "".join(p.response for p in parts) == asyncio.run(grpc_text(head, messages=CHAT))[0]
    assert client.generate(model="m", prompt="").done_reason == "load"


@pytest.mark.slow
def test_list_and_show_report_the_heads_model(client, head):
    (model,) = client.list().models
    info = asyncio.run(_info(head))
    assert model.model == "-".join(info.model_name.split()) and model.digest == info.model_id
    shown = client.show("anything")
    assert shown.modelinfo["general.block_count"] == info.n_layers and "tools" in shown.capabilities


async def _info(head: str):
    control = AioControl(head)
    try:
        return await control.info()
    finally:
        await control.close()
