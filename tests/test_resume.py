"""A request resumed on a new head (Generation.resume): it goes on as if it never moved: same positions, same text,
same stop, a seeded sampler continues its own stream, and a grammar (json_schema, tool calls) goes on where it was."""

import json

import pytest
import torch

from nodes.engine.store import LayerStore
from nodes.generation.sampling import SamplingParams
from nodes.generation.speculate import SpeculateParams
from nodes.generation.state import GenerateParams, Generation, generate_params
from nodes.generation.text import TextCodec
from prima_rpc.request import GenerateRequest

VOCAB = 320


@pytest.fixture(scope="module")
def codec(tiny_store):
    store = LayerStore(tiny_store)
    return TextCodec(store.manifest, store.tokenizer_path())


def run(gen: Generation, logits: list[torch.Tensor]) -> list:
    return [gen.accept(x) for x in logits if not gen.done]


def test_a_resumed_seeded_request_continues_its_own_sample_stream(codec):
    params = GenerateParams(max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=7))
    logits = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    whole = Generation([5, 6, 7], params, codec, (), 64)
    outs = run(whole, logits)
    moved = Generation([5, 6, 7], params, codec, (), 64)
    moved.resume([o.token_id for o in outs[:5]], VOCAB)
    assert moved.pending() == (whole.tokens[4:5], 3 + 4)  # the last given token runs next, at its position
    rest = run(moved, logits[5:])
    assert [o.token_id for o in rest] == whole.tokens[5:] and [o.index for o in rest] == list(range(5, 12))
    assert moved.text == whole.text and moved.finish_reason == whole.finish_reason == "length"


def test_resume_refuses_tokens_outside_the_vocabulary_or_past_the_end(codec):
    gen = Generation([5, 6], GenerateParams(max_tokens=2), codec, (), 64)
    with pytest.raises(ValueError, match="resume_tokens"):
        gen.resume([1, VOCAB], VOCAB)
    gen = Generation([5, 6], GenerateParams(max_tokens=2), codec, (), 64)
    with pytest.raises(ValueError, match="resume_tokens"):
        gen.resume([1, 2, 3], VOCAB)  # the request ends after two
    gen = Generation([5, 6], GenerateParams(max_tokens=2), codec, (), 64)
    gen.resume([1, 2], VOCAB)
    assert gen.done and gen.finish_reason == "length"


def test_a_resumed_json_schema_request_keeps_its_grammar_where_it_was(codec):
    # found by the chaos soak: a json_schema answer resumed on a new head started its grammar over after the given
    # tokens, and went on with a second object inside the first ({"city":"Paris","{"city":...)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"]}
    request = GenerateRequest(prompt="weather", raw=True, max_tokens=24, response_format="json_schema",
                              json_schema=json.dumps(schema))
    params = generate_params(request, SpeculateParams("off"), codec.tool_family)
    logits = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(i)) for i in range(24)]
    whole = Generation([5, 6, 7], params, codec, (), 64, None, VOCAB)
    run(whole, logits)
    moved = Generation([5, 6, 7], params, codec, (), 64, None, VOCAB)
    moved.resume(whole.tokens[:6], VOCAB)
    run(moved, logits[6:])
    assert moved.tokens == whole.tokens and moved.text == whole.text
