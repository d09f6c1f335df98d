"""What agents ask of the OpenAI API, with the official `openai` client on a real 3-node SmolLM2 ring: logprobs, n,
penalties and seeds; n = 3 prefilling its prompt once; JSON that validates; tool calls, forced (their arguments
streamed in pieces) and in a two-turn conversation, streamed and not."""

import asyncio
import json

import jsonschema
import openai
import pytest

from nodes.generation.reference import ReferenceModel
from nodes.generation.speculate import SpeculateParams
from nodes.generation.state import generate_params
from prima_rpc.request import GenerateRequest
from tests.rings import stream
from tests.test_openai_api import CHAT, api_server
from tests.test_prefix_cache_ring import counters, deltas

pytestmark = pytest.mark.slow
COUNT = "1, 2, 3, 4, 5,"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "capital": {"type": "boolean"},
    "population": {"type": "integer", "minimum": 0, "maximum": 999}, "size": {"enum": ["small", "big"]}},
    "required": ["city", "capital", "population", "size"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def head(rings) -> str:
    return rings(3, [10, 10, 10]).addresses[0]


@pytest.fixture(scope="module")
def client(head):
    with api_server(head) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def test_top_logprobs_are_sorted_and_greedy_takes_the_first(client):
    reply = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                           top_logprobs=5)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert entry.top_logprobs[0].token == entry.token and entry.logprob == pytest.approx(tops[0])
    assert "".join(e.token for e in content).startswith(reply.choices[0].message.content[:4])
    raw = client.completions.create(model="m", prompt=COUNT, max_tokens=4, temperature=0, logprobs=2)
    lp = raw.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert all(p <= 0 for p in lp.token_logprobs)


def test_n_choices_are_seeded_and_reproducible(client):
    def texts(**kw):
        reply = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=1.0, seed=11, **kw)
        assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
        return [c.message.content for c in reply.choices]

    three = texts(n=3)
    assert len(three) == 3 and len(set(three)) > 1  # seeds 11, 12, 13
    assert texts(n=3) == three and texts() == three[:1]  # choice i is the request seeded seed + i
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=1.0, seed=11,
                                                 n=3, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == three


def test_seeded_sampling_and_penalties_equal_one_process(head, smol_store):
    model = ReferenceModel(smol_store)
    cases = [dict(temperature=1.0, seed=5), dict(temperature=0.0, frequency_penalty=1.5),
             dict(temperature=0.0, presence_penalty=2.0, repetition_penalty=1.3)]
    plain = asyncio.run(stream(head, COUNT, 12, raw=True, temperature=0.0))[0]
    for fields in cases:
        request = GenerateRequest(COUNT, raw=True, max_tokens=12, **fields)
        expected = [t.token_id for t in model.generate_ids(model.codec.request_ids(request),
                                                           generate_params(request, SpeculateParams("off")))]
        tokens, _ = asyncio.run(stream(head, COUNT, 12, raw=True, speculate="off", **fields))
        assert tokens == expected, fields
        if "seed" not in fields:
            assert tokens != plain, fields  # counting on is what the penalties push away from


def test_json_schema_answers_validate_at_temperature_one(client):
    answers = []
    for seed in range(7):  # 7 x 8 = 56 sampled answers
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Describe a city as JSON."}], max_tokens=48,
            temperature=1.0, seed=100 + 8 * seed, n=8,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
        answers += [c.message.content for c in reply.choices]
    for text in answers:
        jsonschema.validate(json.loads(text), SCHEMA)
    obj = client.chat.completions.create(model="m", messages=CHAT, max_tokens=32, temperature=1.0, seed=3,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_required_tool_choice_always_calls_with_valid_arguments(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        reply = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                               max_tokens=48, temperature=1.0, seed=21, n=8)
        for c in reply.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            assert choice == "required" or call.function.name == "get_time"


def accumulated(chunks) -> dict[int, dict]:
    """The calls of a stream, built from its deltas as OpenAI's docs show: by index, arguments appended."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": "", "pieces": 0})
            entry["id"] = d.id or entry["id"]
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
            entry["pieces"] += bool(d.function.arguments)
    return calls


def test_streamed_calls_send_their_arguments_in_pieces(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=48,
                                                     tool_choice="required", temperature=1.0, seed=seed, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # markup is never text
        (call,) = accumulated(chunks).values()
        assert call["id"].startswith("call_") and call["pieces"] > 1
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
        whole = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=48,
                                               tool_choice="required", temperature=1.0, seed=seed)
        (same,) = whole.choices[0].message.tool_calls
        assert same.function.name == call["name"]
        assert json.loads(same.function.arguments) == json.loads(call["arguments"])
    with client.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=48,
                                        tool_choice="required", temperature=0) as s:  # the client's own helper
        kinds = [e.type for e in s]
        final = s.get_final_completion()
    assert kinds.count("tool_calls.function.arguments.delta") > 1 and "tool_calls.function.arguments.done" in kinds
    (call,) = final.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert final.choices[0].finish_reason == "tool_calls" and not final.choices[0].message.content


def test_n_choices_over_http_prefill_the_prompt_once(client, head):
    """n = 3 with a seed: three different choices, the same again when asked again; the prompt's whole blocks are
    prefilled once on every node (the other two choices take them from the prefix cache), all of them the second
    time (status --json's counters, read the same way)."""
    system = "You answer in one short line. " + " ".join(f"Fact {i}: the lamp in room {i} is blue." for i in range(20))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which lamp is blue?"}]

    def ask():
        before = counters(head)
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=1.0, seed=7,
                                               n=3)
        return [c.message.content for c in reply.choices], reply.usage.prompt_tokens, deltas(before, counters(head))

    texts, n, first = ask()
    shared = (n - 1) // 64 * 64  # the whole blocks a choice may take (never its last token)
    assert shared >= 128 and len(set(texts)) == 3
    assert first == [(n + 2 * (n - shared), 2 * shared)] * 3
    again, _, second = ask()
    assert again == texts and second == [(3 * (n - shared), 3 * shared)] * 3


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
def test_two_turn_tool_conversation(client, streamed):
    ask = dict(model="m", tools=[WEATHER], max_tokens=40, temperature=0)
    if streamed:
        chunks = list(client.chat.completions.create(messages=ASK, tool_choice="required", stream=True, **ask))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        (call,) = accumulated(chunks).values()
        call = {"id": call["id"], "type": "function", "function": {"name": call["name"],
                                                                   "arguments": call["arguments"]}}
    else:
        first = client.chat.completions.create(messages=ASK, tool_choice="required", **ask)
        assert first.choices[0].finish_reason == "tool_calls"
        call = first.choices[0].message.tool_calls[0].model_dump()
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature_c": 21})}]
    if streamed:
        chunks = list(client.chat.completions.create(messages=history, tool_choice="none", stream=True, **ask))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        final = client.chat.completions.create(messages=history, tool_choice="none", **ask)
        text, finish = final.choices[0].message.content, final.choices[0].finish_reason
    assert text and finish in ("stop", "length")
