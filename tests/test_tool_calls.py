"""Tool calls and constrained decoding at the head, no ring: parsing every family's markup, the prompts tools make,
held-back streaming, and llguidance's grammars on the real SmolLM2 tokenizer and model."""

import json

import jsonschema
import pytest

from nodes.generation import tool_calls
from nodes.generation.constrain import Constraint, grammar
from nodes.generation.reference import ReferenceModel
from nodes.generation.sampling import Penalties, logprobs, penalize
from nodes.generation.speculate import SpeculateParams
from nodes.generation.state import Generation, generate_params
from nodes.generation.text import PromptError
from prima_rpc.request import GenerateRequest, Message, Tool, ToolCall

ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = Tool("get_weather", "The weather in a city.", json.dumps(ARGS))
ASK = (Message("user", "What is the weather in Paris?"),)


@pytest.mark.parametrize("text, content, calls", [
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure.", [("f", {"a": 1})]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"b": "x"}}'
     "</tool_call>", "", [("f", {}), ("g", {"b": "x"})]),
    ('{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),  # Llama 3.x
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}', "", [("f", {}), ("g", {})]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 2}}]', "", [("f", {"a": 2})]),  # Mistral
    ('[{"name": "f", "arguments": {"a": 2}}]', "", [("f", {"a": 2})]),  # Mistral, its marker decoded away
    ("<tool_call>\n{not json}\n</tool_call>", None, []),  # malformed: plain text after all
    ('{"answer": 42}', None, []),  # JSON that is no call
    ("Just words.", None, []),
])
def test_parse_reads_every_family(text, content, calls):
    got_content, got = tool_calls.parse(text)
    assert got_content == (text if content is None else content)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("template, family", [
    ("{% for m in messages %}<tool_call>{% endfor %}", "hermes"), ("[TOOL_CALLS] {{ tools }}", "mistral"),
    ("<|python_tag|>{{ tools }}", "llama3"), ("{{ messages }}", "hermes"), (None, "hermes")])
def test_family_is_read_off_the_template(template, family):
    assert tool_calls.family(template) == family


def test_generic_prompt_offers_tools_and_writes_history_as_markup():
    history = (*ASK, Message("assistant", "", (ToolCall("c1", "get_weather", '{"city": "Paris"}'),)),
               Message("tool", "21 C", tool_call_id="c1", name="get_weather"))
    generic = tool_calls.template_messages(history, (WEATHER,), native=False)
    assert generic[0]["role"] == "system" and '"name": "get_weather"' in generic[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in generic[2]["content"]
    assert generic[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
    native = tool_calls.template_messages(history, (WEATHER,), native=True)
    assert native[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert native[2] == {"role": "tool", "content": "21 C", "tool_call_id": "c1", "name": "get_weather"}


@pytest.fixture(scope="module")
def smol(smol_store) -> ReferenceModel:
    return ReferenceModel(smol_store)


def run(model: ReferenceModel, request: GenerateRequest) -> Generation:
    params = generate_params(request, SpeculateParams("off"), model.codec.tool_family)
    gen = Generation(model.codec.request_ids(request), params, model.codec, model.store.manifest.eos_token_ids,
                     model.cfg.max_seq_len, None, model.cfg.vocab)
    cache = model.new_cache(gen.capacity)
    while not gen.done:
        ids, pos = gen.pending()
        gen.accept(model.step(ids, pos, cache))
    return gen


@pytest.mark.slow
def test_native_template_gets_tools(smol):
    codec = smol.codec
    saved = codec.template
    codec.template = codec.template.environment.from_string(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
        "{% endfor %}")
    try:
        text = codec.chat_prompt(tool_calls.template_messages(ASK, (WEATHER,), True),
                                 tool_calls.openai_tools((WEATHER,)))
    finally:
        codec.template = saved
    assert text == "[get_weather]user:What is the weather in Paris?"


@pytest.mark.slow
def test_forced_calls_validate_and_stream_nothing(smol):
    for seed in range(4):
        gen = run(smol, GenerateRequest(messages=ASK, tools=(WEATHER,), tool_choice="required", max_tokens=40,
                                        temperature=1.0, seed=seed))
        assert gen.finish_reason == "tool_calls" and gen.text == ""  # the markup is held back, not streamed
        (call,) = gen.tool_calls
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), ARGS)


@pytest.mark.slow
def test_json_schema_holds_at_temperature_one(smol):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9,
                                                                                 "minimum": 0}},
              "required": ["ok", "n"], "additionalProperties": False}
    for seed in range(4):
        gen = run(smol, GenerateRequest(messages=ASK, max_tokens=24, temperature=1.0, seed=seed,
                                        response_format="json_schema", json_schema=json.dumps(schema)))
        assert gen.finish_reason == "stop"
        jsonschema.validate(json.loads(gen.text), schema)


@pytest.mark.slow
def test_auto_text_without_a_call_is_handed_out(smol):
    gen = run(smol, GenerateRequest(messages=ASK, tools=(WEATHER,), max_tokens=12, temperature=0))
    assert gen.tool_calls == [] and gen.text == smol.codec.decode(gen.tokens)


@pytest.mark.slow
def test_a_schema_the_grammar_cannot_follow_is_refused(smol):
    request = GenerateRequest(messages=ASK, response_format="json_schema",
                              json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "frob"}}}))
    with pytest.raises(PromptError, match="output format"):
        Constraint(grammar(request, "hermes"), smol.codec, smol.cfg.vocab)


def test_penalties_and_logprobs_by_table():
    import torch
    logits = torch.tensor([2.0, 1.0, -1.0, 0.5])
    counts, seen = torch.tensor([2.0, 0.0, 1.0, 0.0]), torch.tensor([True, False, True, True])
    assert penalize(logits, counts, seen, Penalties(frequency=0.5)).tolist() == [1.0, 1.0, -1.5, 0.5]
    assert penalize(logits, counts, seen, Penalties(presence=1.0)).tolist() == [1.0, 1.0, -2.0, 0.5]
    assert penalize(logits, counts, seen, Penalties(repetition=2.0)).tolist() == [1.0, 1.0, -2.0, 0.25]
    lp, top = logprobs(logits, 1, 2)
    assert [t for t, _ in top] == [0, 1] and lp == pytest.approx(top[1][1])
    assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
