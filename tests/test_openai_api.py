"""The OpenAI-compatible HTTP API: request validation by table, and the official `openai` client on a real ring."""

import asyncio
import contextlib
import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from prima_rpc.app import ring
from prima_rpc.app.local_ring import free_ports
from prima_rpc.app.openai_api import ApiConfig, ApiError, model_id, parse_request
from prima_rpc.client import PrimaClient, Token
from prima_rpc.request import GenerateRequest, Message
from tools.bench.http_harness import api_in_thread

CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the capital of France?"}]
RAW = "The three primary colors are"
TOKENS = 10


@contextlib.contextmanager
def api_server(head: str, token: str | None = None):
    """The HTTP API on a free port, served by a background thread's event loop; yields its base URL (.../v1)."""
    with api_in_thread(ApiConfig(head, token)) as root:
        yield root + "/v1"


def post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as res:
            return res.status, json.loads(res.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def assert_openai_error(body: dict, param: str | None = None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], body
    assert error["param"] == param, body


# ---------------------------------------------------------------- validation, no ring


@pytest.mark.parametrize("body, param, message", [
    ([], None, "JSON object"),
    ({}, "messages", "Missing required parameter: 'messages'"),
    ({"messages": []}, "messages", "non-empty array"),
    ({"messages": "hi"}, "messages", "non-empty array"),
    ({"messages": ["hi"]}, "messages[0]", "expected an object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of system"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "string or text content parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text content"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens", "integer in [1,"),
    ({"messages": CHAT, "max_tokens": 2.5}, "max_tokens", "integer in [1,"),
    ({"messages": CHAT, "max_tokens": True}, "max_tokens", "integer in [1,"),
    ({"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens", "integer in [1,"),
    ({"messages": CHAT, "temperature": 2.5}, "temperature", "number in [0, 2]"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature", "number in [0, 2]"),
    ({"messages": CHAT, "top_p": 1.5}, "top_p", "number in [0, 1]"),
    ({"messages": CHAT, "seed": "7"}, "seed", "integer"),
    ({"messages": CHAT, "stop": ""}, "stop", "non-empty string"),
    ({"messages": CHAT, "stop": ["a"] * 17}, "stop", "up to 16"),
    ({"messages": CHAT, "n": 9}, "n", "integer in [1, 8]"),
    ({"messages": CHAT, "logprobs": 3}, "logprobs", "boolean"),
    ({"messages": CHAT, "top_logprobs": 3}, "top_logprobs", "needs logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "integer in [0, 20]"),
    ({"messages": CHAT, "presence_penalty": 3}, "presence_penalty", "number in [-2, 2]"),
    ({"messages": CHAT, "frequency_penalty": "x"}, "frequency_penalty", "number in [-2, 2]"),
    ({"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty", "number in (0, 10]"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0]", "expected"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1]", "its own"),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": CHAT, "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "a tool"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema"),
    ({"messages": CHAT, "logit_bias": {"1": 5}}, "logit_bias", "Unsupported"),
    ({"messages": CHAT, "stream": "yes"}, "stream", "boolean"),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only with stream"),
    ({"messages": CHAT, "model": 3}, "model", "string"),
    ({"messages": CHAT, "speculate": "magic"}, "speculate", "one of off, ngram, draft"),
    ({"messages": CHAT, "draft_tokens": 17}, "draft_tokens", "integer in"),
    ({"messages": CHAT, "chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "expected an object"),
    ({"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "not a variable"),
])
def test_bad_chat_bodies_name_the_parameter(body, param, message):
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=True, default_max_tokens=64)
    assert err.value.status == 400 and err.value.param == param and message in err.value.message


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 2]}, "prompt"),
    ({"prompt": "hi", "echo": True}, "echo"), ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),  # no template
])
def test_bad_completion_bodies_name_the_parameter(body, param):
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=False, default_max_tokens=64)
    assert err.value.status == 400 and err.value.param == param


def test_good_bodies_become_generate_arguments():
    call = parse_request({"model": "x", "messages": [{"role": "developer", "content": "Be brief."},
                                                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}],
                          "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": -1, "stop": "\n",
                          "n": 1, "stream": True, "stream_options": {"include_usage": True}, "user": "ignored"},
                         chat=True, default_max_tokens=64)
    assert call.request == GenerateRequest(messages=(Message("system", "Be brief."), Message("user", "a\nb")),
                                           max_tokens=5, temperature=0.5, top_p=0.9, seed=2**64 - 1, stop=("\n",))
    assert call.stream and call.include_usage and call.model == "x"
    think = parse_request({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}, True, 8).request
    assert think.template_kwargs() == {"enable_thinking": False}
    spec = parse_request({"prompt": "hi", "speculate": "ngram", "draft_tokens": 3, "depth": 4}, chat=False,
                         default_max_tokens=8)
    assert (spec.request.speculate, spec.request.draft_tokens, spec.request.depth) == ("ngram", 3, 4)
    plain = parse_request({"prompt": ["hi"], "top_p": 0}, chat=False, default_max_tokens=64).request
    assert plain.raw and plain.max_tokens == 64 and plain.prompt == "hi"
    assert plain.temperature == 0.0  # top_p 0 keeps only the likeliest token: greedy
    assert parse_request({"prompt": "hi"}, chat=False, default_max_tokens=64).request.temperature is None  # the model's
    assert parse_request({"prompt": "hi"}, False, 64, default_temperature=0.7).request.temperature == 0.7  # serve's


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "caf\udce9"}, "prompt", "the prompt is not valid UTF-8"),  # JSON may carry lone surrogates
    ({"prompt": "hi", "stop": ["a", "\udce9"]}, "stop", "a stop string is not valid UTF-8"),
    ({"prompt": "hi", "max_tokens": 0, "max_completion_tokens": 3}, None, None),  # the newer name wins
    ({"prompt": "hi", "max_completion_tokens": 0}, "max_completion_tokens", "integer in [1,"),
    ({"prompt": "hi", "top_p": 0, "temperature": 2.5}, "temperature", "number in [0, 2]"),  # checked before greedy
    ({"prompt": "hi", "draft_tokens": 0}, "draft_tokens", "integer in [1, 16]"),
    ({"prompt": "hi", "depth": 0}, "depth", "integer in [1, 16]"),
    ({"prompt": "hi", "depth": 17}, "depth", "integer in [1, 16]"),
    ({"prompt": "hi", "top_k": -1}, "top_k", "integer in [0,"),
])
def test_bodies_are_checked_by_the_request_type(body, param, message):
    if param is None:
        assert parse_request(body, chat=False, default_max_tokens=64).request.max_tokens == 3
        return
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=False, default_max_tokens=64)
    assert err.value.status == 400 and err.value.param == param and message in err.value.message


def test_chat_content_that_is_not_text_names_its_message():
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text",
                                                                                         "text": "\udce9"}]}]}
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=True, default_max_tokens=64)
    assert err.value.param == "messages[1].content" and "a message is not valid UTF-8" in err.value.message


def test_http_errors_without_a_ring_have_openai_shape():
    (dead,) = free_ports(1)  # nothing listens there: the head is unavailable
    with api_server(f"127.0.0.1:{dead}") as url:
        status, body = post(url + "/chat/completions", b"{not json")
        assert status == 400 and "could not parse the JSON body" in body["error"]["message"]
        assert_openai_error(body)
        status, body = post(url + "/chat/completions", json.dumps({"model": "m", "messages": CHAT}).encode())
        assert status == 503 and body["error"]["type"] == "server_error" and body["error"]["code"] == "unavailable"
        message = body["error"]["message"]  # one line, as prima-ctl prints it: no gRPC dump
        assert message.startswith(f"cannot reach node 127.0.0.1:{dead}: ") and "is prima-node running there?" in message
        assert "\n" not in message and "AioRpcError" not in message and "debug_error_string" not in message
        status, body = post(url + "/chat/completions", json.dumps({"messages": CHAT, "temperature": 2.5}).encode())
        assert status == 400 and body["error"]["param"] == "temperature"  # the range the CLI and client take
        status, body = post(url + "/completions", b'{"prompt": "caf\\udce9"}')  # a lone surrogate: not UTF-8
        assert status == 400 and "not valid UTF-8" in body["error"]["message"]
        status, body = post(url + "/embeddings", b"{}")
        assert status == 404
        assert_openai_error(body)


def test_token_is_required_as_bearer_key():
    (dead,) = free_ports(1)
    with api_server(f"127.0.0.1:{dead}", token="s3cret") as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, body = post(url + "/completions", b"{}", headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", headers
        status, body = post(url + "/completions", b"{}", {"Authorization": "Bearer s3cret"})
        assert status == 400 and body["error"]["param"] == "prompt"  # past the key check
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()


# ---------------------------------------------------------------- a real 3-node ring


@pytest.fixture(scope="module")
def head(rings) -> str:
    return rings(3, [10, 10, 10]).addresses[0]


@pytest.fixture(scope="module")
def api(head):
    with api_server(head) as url:
        yield url


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=60)


async def grpc_text(head: str, prompt: str = "", **kwargs) -> tuple[str, object]:
    text, done = [], None
    async with PrimaClient(head) as c:
        async for event in c.generate(prompt, max_tokens=TOKENS, temperature=0.0, **kwargs):
            if isinstance(event, Token):
                text.append(event.text)
            else:
                done = event
    return "".join(text), done


@pytest.mark.slow
def test_models_report_the_heads_model(client, head):
    (model,) = client.models.list().data
    assert model.id == model_id(ring.walk(head)[0][1].model_name) and model.owned_by == "prima-rpc"
    assert " " not in model.id and client.models.retrieve(model.id).id == model.id
    assert client.models.retrieve("prima").id == "prima"  # any name is the ring's model, as for completions


@pytest.mark.slow
def test_chat_equals_the_grpc_client(client, head):
    expected, done = asyncio.run(grpc_text(head, messages=CHAT))
    reply = client.chat.completions.create(model="any", messages=CHAT, max_tokens=TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == done.finish_reason and reply.object == "chat.completion"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (done.prompt_tokens, done.completion_tokens)
    assert reply.usage.total_tokens == done.prompt_tokens + done.completion_tokens
    assert reply.usage.model_extra["drafted"] == done.drafted  # the head's default (ngram) both ways
    fast = client.chat.completions.create(model="any", messages=CHAT, max_tokens=TOKENS, temperature=0,
                                          extra_body={"speculate": "ngram", "draft_tokens": 4})
    assert fast.choices[0].message.content == expected  # greedy speculation: the same text
    assert 0 <= fast.usage.model_extra["accepted"] <= fast.usage.model_extra["drafted"]
    plain = client.chat.completions.create(model="any", messages=CHAT, max_tokens=TOKENS, temperature=0,
                                           extra_body={"speculate": "off"})
    assert plain.choices[0].message.content == expected and plain.usage.model_extra["drafted"] == 0

    chunks = list(client.chat.completions.create(model="any", messages=CHAT, max_tokens=TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == done.completion_tokens
    assert len({c.id for c in chunks}) == 1


@pytest.mark.slow
def test_completions_are_raw_and_equal_the_grpc_client(client, head):
    expected, done = asyncio.run(grpc_text(head, RAW, raw=True))
    reply = client.completions.create(model="any", prompt=RAW, max_tokens=TOKENS, temperature=0)
    assert reply.choices[0].text == expected and reply.usage.prompt_tokens == done.prompt_tokens
    streamed = list(client.completions.create(model="any", prompt=RAW, max_tokens=TOKENS, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == done.finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("data, param", [
    (b'{"messages": [', None),
    (json.dumps({"model": "m", "messages": CHAT, "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": "m"}).encode(), "messages"),
    (json.dumps({"model": "m", "messages": CHAT, "n": 0}).encode(), "n"),
])
def test_bad_requests_get_400_in_openai_shape(api, data, param):
    status, body = post(api + "/chat/completions", data)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert_openai_error(body, param)


@pytest.mark.slow
def test_head_rejections_keep_their_status(client):
    # The head itself refuses a prompt longer than the model's context: INVALID_ARGUMENT -> 400.
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="any", prompt="hello " * 9000, max_tokens=4, temperature=0)
    assert "context" in err.value.message


@pytest.mark.slow
def test_curl_streams_from_the_cli_server(head):
    (port,) = free_ports(1)
    server = subprocess.Popen([sys.executable, "-m", "prima_rpc.app.cli", "--node", head, "serve", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "serving" in server.stdout.readline()
        body = json.dumps({"model": "m", "messages": CHAT, "max_tokens": TOKENS, "temperature": 0, "stream": True})
        res = subprocess.run(["curl", "-sN", "--max-time", "60", f"http://127.0.0.1:{port}/v1/chat/completions",
                              "-H", "Content-Type: application/json", "-d", body],
                             capture_output=True, text=True, timeout=90)
        events = [line.removeprefix("data: ") for line in res.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", res.stdout
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert text == asyncio.run(grpc_text(head, messages=CHAT))[0]
    finally:
        server.terminate()  # SIGTERM: a graceful stop
        out, err = server.communicate(timeout=15)
    assert server.returncode == 0 and "stopped" in out, err


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_cancels_the_ring_request(api, head, stream):
    host, port = api.removeprefix("http://").removesuffix("/v1").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    # Counting never ends by itself: without cancellation the head would run all 1000 tokens (minutes).
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 1000,
                                                        "temperature": 0, "stream": stream}),
                 {"Content-Type": "application/json"})
    if stream:
        res = conn.getresponse()
        assert res.status == 200 and res.readline().startswith(b"data: ")
        res.close()
    else:
        deadline = time.monotonic() + 10
        while not ring.walk(head)[0][1].stats.active_requests:
            assert time.monotonic() < deadline, "the request never reached the head"
            time.sleep(0.1)
    assert ring.walk(head)[0][1].stats.active_requests == 1
    conn.close()
    deadline = time.monotonic() + 10
    while any(info.stats.active_requests for _, info in ring.walk(head)):
        assert time.monotonic() < deadline, "the ring still holds the request after its client left"
        time.sleep(0.2)
