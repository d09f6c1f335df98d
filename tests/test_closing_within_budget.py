"""Structured output that always parses: where max_tokens would cut a json_schema answer or a forced tool call, the
grammar closes it within the budget (nodes/generation/constrain.py). Sampled at temperature 1 with small budgets,
every answer is complete JSON that validates; where the budget is too small for any closing, the cut stays."""

import json

import jsonschema
import pytest

from nodes.generation.reference import ReferenceModel
from nodes.generation.speculate import SpeculateParams
from nodes.generation.state import generate_params
from prima_rpc.request import GenerateRequest, Tool

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items":
                                                                               {"type": "string"}},
                                           "size": {"type": "integer"}},
          "required": ["name", "tags", "size"], "additionalProperties": False}
WEATHER = Tool("get_weather", "The weather now in a city.", json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
     "required": ["city", "days"], "additionalProperties": False}))


def answer(model: ReferenceModel, request: GenerateRequest) -> tuple[str, str, str]:
    """(text, the calls' arguments, finish reason) of one request on the single-process reference."""
    outs = list(model.generate_ids(model.codec.request_ids(request), generate_params(request, SpeculateParams("off"),
                                                                                      model.codec.tool_family)))
    arguments = "".join(c.arguments for o in outs for c in o.calls)
    return "".join(o.text for o in outs), arguments, model.finish_reason


def schema_request(prompt: str, budget: int, seed: int, raw: bool = False) -> GenerateRequest:
    return GenerateRequest(prompt, raw=raw, max_tokens=budget, temperature=1.0, seed=seed,
                           response_format="json_schema", json_schema=json.dumps(SCHEMA))


@pytest.mark.parametrize("budget", [12, 16, 24, 40])
def test_a_random_model_at_temperature_one_closes_its_json_in_the_budget(tiny_store, budget):
    """The tiny store's byte tokenizer: `{"name":"","tags":[],"size":0}` is 30 tokens, so 12 and 16 cannot close."""
    model = ReferenceModel(tiny_store)
    for seed in range(8):
        text, _, reason = answer(model, schema_request("x", budget, seed, raw=True))
        if budget < 30:
            assert reason == "length"  # no closing fits: the cut stays what it was
            continue
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.slow  # SmolLM2 sampling ~500 tokens
def test_smollm2_json_and_tool_calls_at_temperature_one_parse_in_small_budgets(smol_store):
    model = ReferenceModel(smol_store)
    for budget in (24, 40):  # the JSON's shortest closing is 19 tokens; a call's, with its markup, about 30
        for seed in range(3):
            text, _, _ = answer(model, schema_request("Describe a city you like as JSON.", budget, seed))
            jsonschema.validate(json.loads(text), SCHEMA)
            if budget < 30:
                continue
            call = GenerateRequest("What is the weather in Paris this week?", max_tokens=budget, temperature=1.0,
                                   seed=seed, tools=(WEATHER,), tool_choice="required")
            _, arguments, reason = answer(model, call)
            assert reason == "tool_calls", (budget, seed, arguments)
            jsonschema.validate(json.loads(arguments), json.loads(WEATHER.parameters))
