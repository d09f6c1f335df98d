"""Tool calls read while they are generated (nodes/generation/tool_stream.py): every family's markup split at
arbitrary boundaries gives the same ids, names and arguments as the whole text, text after a call makes no delta,
a generation's tokens carry the deltas (on SmolLM2's tokenizer, and on SmolLM2 itself with a forced call), and
the OpenAI and Anthropic streams turn them into their chunks and events."""

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from nodes.engine.store import LayerStore
from nodes.generation.speculate import SpeculateParams
from nodes.generation.state import GenerateParams, Generation, generate_params
from nodes.generation.text import TextCodec
from nodes.generation.tool_stream import CallStream
from prima_rpc.app import ollama_api
from prima_rpc.app.anthropic_api import Blocks, content_blocks
from prima_rpc.app.openai_choices import ChoiceStream
from prima_rpc.client import Finished, Token
from prima_rpc.request import GenerateRequest, ToolCall, ToolCallDelta
from tests.test_tool_calls import ARGS, ASK, WEATHER, run, smol  # noqa: F401 (smol: a fixture)

ANSWERS = {  # text -> [(name, its arguments' text as written)]
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "tags": ["a}", "b\\"{"]}}\n'
               "</tool_call>", [("get_weather", '{"city": "Paris", "tags": ["a}", "b\\"{"]}')]),
    "hermes, two, text after": (
        '<tool_call>{"name":"f","arguments":{}}</tool_call>\n<tool_call>\n{"name": "g", "arguments": {"b": {"c": 1}}}'
        '\n</tool_call>\nDone. {"name": "h", "arguments": {}}', [("f", "{}"), ("g", '{"b": {"c": 1}}')]),
    "llama3": ('{"name": "f", "parameters": {"a": 1}}', [("f", '{"a": 1}')]),
    "llama3, python tag": ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": "y;"}}',
                           [("f", "{}"), ("g", '{"x": "y;"}')]),
    "mistral": ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 2}}, {"name": "g", "arguments": {"s": "[,{"}}]',
                [("f", '{"a": 2}'), ("g", '{"s": "[,{"}')]),
    "mistral, marker decoded away": ('[{"name": "f", "arguments": {"a": 2}}]', [("f", '{"a": 2}')]),
}


def feed(pieces: list[str]) -> tuple[CallStream, list]:
    stream, deltas, text = CallStream(), [], ""
    for piece in pieces:
        text += piece
        deltas += stream.feed(text)
    return stream, deltas


def splits(text: str, seed: int) -> list[str]:
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), k=min(8, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def accumulated(deltas) -> list[dict]:
    """The calls as a client builds them from the deltas (OpenAI's way: by index, arguments appended)."""
    calls: list[dict] = []
    for d in deltas:
        if d.name:
            assert d.index == len(calls) and d.id.startswith("call_") and not d.arguments
            calls.append({"id": d.id, "name": d.name, "arguments": ""})
        else:
            assert d.index == len(calls) - 1 and not d.id
            calls[d.index]["arguments"] += d.arguments
    return calls


@pytest.mark.parametrize("case", list(ANSWERS))
def test_any_split_streams_the_calls_the_whole_text_holds(case):
    text, expected = ANSWERS[case]
    ways = [[text], list(text)] + [splits(text, seed) for seed in range(20)]
    for pieces in ways:
        stream, deltas = feed(pieces)
        calls = accumulated(deltas)
        assert [(c["name"], c["arguments"]) for c in calls] == expected, pieces
        content, whole, complete = stream.finish(text)
        assert complete and content == ""
        assert [(c.id, c.name, json.loads(c.arguments)) for c in whole] == [
            (c["id"], c["name"], json.loads(c["arguments"])) for c in calls]  # the same calls, under the same ids
    one_by_one = feed(list(text))[1]
    assert all(sum(1 for d in one_by_one if d.index == i and d.arguments) > 1 for i in range(len(expected)))


@pytest.mark.parametrize("text", ['{"answer": 42}', "[1, 2]", '<tool_call>\n{not json}\n</tool_call>'])
def test_what_is_no_call_streams_nothing_and_stays_text(text):
    stream, deltas = feed(list(text))
    assert deltas == [] and stream.finish(text) == (text, [], False)


def test_a_call_in_another_key_order_comes_whole_at_the_end():
    text = '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'
    stream, deltas = feed(list(text))
    assert deltas == []
    _, (call,), complete = stream.finish(text)
    assert complete and call.name == "f" and json.loads(call.arguments) == {"a": 1}


def test_a_call_cut_short_stays_a_call_not_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    stream, deltas = feed(splits(text, 3))
    assert accumulated(deltas) == [{"id": deltas[0].id, "name": "get_weather", "arguments": '{"city": "Par'}]
    content, (call,), complete = stream.finish(text)
    assert content == "" and not complete and call.id == deltas[0].id and call.arguments == '{"city": "Par'


@pytest.fixture(scope="module")
def codec(smol_store: Path) -> TextCodec:
    store = LayerStore(smol_store)
    return TextCodec(store.manifest, store.tokenizer_path())


def test_generation_tokens_carry_the_deltas_and_hold_the_markup(codec):
    """The answer's tokens sampled one by one (their logits one-hot): content before the call streams as text,
    the call only as deltas, the text after it nowhere; Finished's call has the streamed id."""
    answer = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nOk.'
    ids = codec.tokenizer.encode(answer, add_special_tokens=False).ids
    vocab = codec.tokenizer.get_vocab_size()
    eos = codec.manifest.eos_token_ids
    gen = Generation([1, 2, 3], GenerateParams(max_tokens=200, tools=True), codec, eos, 4096, vocab=vocab)
    outs = []
    for token in [*ids, eos[0]]:
        logits = torch.full((vocab,), -1e9)
        logits[token] = 0.0
        outs.append(gen.accept(logits))
    assert "".join(o.text for o in outs) == "Let me look.\n" and gen.finish_reason == "tool_calls"
    (call,) = accumulated([d for o in outs for d in o.calls])
    assert call["arguments"] == '{"city": "Paris"}' and sum(1 for o in outs for d in o.calls if d.arguments) > 1
    assert gen.tool_calls[0].id == call["id"] and json.loads(gen.tool_calls[0].arguments) == {"city": "Paris"}


@pytest.mark.slow
def test_forced_call_on_smollm2_streams_arguments_that_validate(smol):  # noqa: F811
    request = GenerateRequest(messages=ASK, tools=(WEATHER,), tool_choice="required", max_tokens=40,
                              temperature=1.0, seed=2)
    params = generate_params(request, SpeculateParams("off"), smol.codec.tool_family)
    outs = list(smol.generate_ids(smol.codec.request_ids(request), params))
    (call,) = accumulated([d for o in outs for d in o.calls])
    jsonschema.validate(json.loads(call["arguments"]), ARGS)
    assert not "".join(o.text for o in outs)
    assert sum(1 for o in outs for d in o.calls if d.arguments) > 1
    gen = run(smol, request)
    assert gen.finish_reason == "tool_calls" and json.loads(gen.tool_calls[0].arguments) == json.loads(
        call["arguments"])


def _events():
    """A streamed answer: text, a call streamed in three pieces, then the end with it and a call not streamed."""
    first, later = ToolCall("call_a", "f", '{"x": 1}'), ToolCall("call_b", "g", "{}")
    tokens = [Token(1, "Hi.", 0, 0.0), Token(2, "", 1, 0.0, tool_calls=(ToolCallDelta(0, "call_a", "f"),)),
              Token(3, "", 2, 0.0, tool_calls=(ToolCallDelta(0, arguments='{"x"'),)),
              Token(4, "", 3, 0.0, tool_calls=(ToolCallDelta(0, arguments=": 1}"),))]
    return [*tokens, Finished("tool_calls", 5, 4, 1.0, 1.0, "r", tool_calls=(first, later))]


def test_openai_chunks_stream_a_call_then_send_the_rest_whole():
    stream = ChoiceStream(chat=True, index=0, logprobs=False)
    deltas = [c["delta"] for e in _events() for c in stream.choices(e)]
    assert deltas == [
        {"content": "Hi."},
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
        {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                         "function": {"name": "g", "arguments": "{}"}}]},
        {}]


def test_anthropic_blocks_stream_a_call_then_send_the_rest_whole():
    blocks = Blocks()
    events = [json.loads(raw.decode().split("data: ", 1)[1]) for e in _events() for raw in blocks.events(e)]
    shape = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events]
    assert shape == [("content_block_start", 0, "text"), ("content_block_delta", 0, "text_delta"),
                     ("content_block_stop", 0, None), ("content_block_start", 1, "tool_use"),
                     ("content_block_delta", 1, "input_json_delta"), ("content_block_delta", 1, "input_json_delta"),
                     ("content_block_stop", 1, None), ("content_block_start", 2, "tool_use"),
                     ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
                     ("message_delta", None, None), ("message_stop", None, None)]
    assert events[3]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "f", "input": {}}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_call_cut_short_reads_as_no_input_in_whole_answers():
    cut = ToolCall("call_a", "f", '{"city": "Par')
    assert content_blocks("", (cut,)) == [{"type": "tool_use", "id": "call_a", "name": "f", "input": {}}]
    line = ollama_api.part("m", True, "", Finished("length", 5, 4, 1.0, 1.0, "r", tool_calls=(cut,)))
    assert line["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {}}}]
    assert line["done_reason"] == "length"
