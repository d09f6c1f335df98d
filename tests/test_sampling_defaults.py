"""A request that names no temperature samples with the model's settings (its store's, else sampling.DEFAULTS: a
llama.cpp-like set); temperature 0 stays greedy; seeded default sampling is reproducible and the same on a ring."""

import json
from dataclasses import replace

import pytest
import torch

from nodes.generation.reference import ReferenceModel
from nodes.generation.sampling import DEFAULTS, Penalties, Sampler, SamplingParams, model_defaults
from nodes.generation.speculate import SpeculateParams
from nodes.generation.state import Generation, generate_params, with_model_sampling
from prima_rpc.request import GenerateRequest
from tests.rings import collect, local_ring
from tools.synth import synth

PROMPT = "the cat sat on the mat and the cat"


def params(request: GenerateRequest):
    return generate_params(request, SpeculateParams("off"))


def test_no_temperature_is_the_default_set_and_what_the_request_names_stays():
    p = with_model_sampling(params(GenerateRequest("hi", temperature=None, top_k=5, seed=3)), {})
    assert p.sampling == SamplingParams(DEFAULTS["temperature"], 5, DEFAULTS["top_p"], 3, DEFAULTS["min_p"])
    assert p.penalties == Penalties(repetition=DEFAULTS["repeat_penalty"], window=DEFAULTS["repeat_last_n"])
    greedy = params(GenerateRequest("hi", temperature=0.0))
    assert not greedy.model_sampling and greedy.sampling.temperature == 0.0 and greedy.penalties.off
    assert params(GenerateRequest("hi", temperature=None)).model_sampling


def test_the_stores_settings_win_and_bad_ones_are_ignored():
    d = model_defaults({"temperature": 0.6, "top_k": 20, "top_p": "high", "min_p": 3.0, "unknown": 1})
    assert d == {**DEFAULTS, "temperature": 0.6, "top_k": 20}


def test_the_wire_tells_no_temperature_from_zero():
    for temperature in (None, 0.0, 0.7):
        sent = GenerateRequest("hi", temperature=temperature).to_wire()
        assert GenerateRequest.from_wire(type(sent).FromString(sent.SerializeToString())).temperature == \
            (None if temperature is None else pytest.approx(temperature))


def test_min_p_drops_tokens_far_below_the_likeliest():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01]))
    probs = Sampler(SamplingParams(1.0, min_p=0.05)).probs(logits)
    assert probs[4] == 0 and probs[3] > 0  # 0.01 < 0.05 * 0.5 <= 0.04
    assert torch.allclose(probs[:4], torch.tensor([0.5, 0.3, 0.15, 0.04]) / 0.99)


@pytest.fixture(scope="module")
def greedy_store(tmp_path_factory):
    """A tiny store whose own sampling setting is temperature 0."""
    store = synth(tmp_path_factory.mktemp("stores") / "greedy", "tiny", seed=1)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**manifest, "sampling": {"temperature": 0.0,
                                                                              "repeat_penalty": 1.0}}))
    return store


def tokens(model: ReferenceModel, request: GenerateRequest) -> list[int]:
    return [t.token_id for t in model.generate_ids(model.codec.request_ids(request), params(request))]


def test_a_store_that_says_greedy_decodes_greedily(greedy_store):
    model = ReferenceModel(greedy_store)
    assert tokens(model, GenerateRequest(PROMPT, raw=True, max_tokens=16, temperature=None)) == \
        tokens(model, GenerateRequest(PROMPT, raw=True, max_tokens=16, temperature=0.0))


def test_seeded_default_sampling_is_reproducible_and_not_greedy(tiny_store):
    model = ReferenceModel(tiny_store)
    seeded = [tokens(model, GenerateRequest(PROMPT, raw=True, max_tokens=24, temperature=None, seed=s))
              for s in (7, 7, 8)]
    assert seeded[0] == seeded[1] and seeded[0] != seeded[2]
    assert seeded[0] != tokens(model, GenerateRequest(PROMPT, raw=True, max_tokens=24, temperature=0.0))


def test_the_repeat_penalty_counts_only_its_window(tiny_store):
    """A window of 1: only the last token is penalised, so a token seen earlier keeps its logit."""
    model = ReferenceModel(tiny_store)
    request = GenerateRequest(PROMPT, raw=True, max_tokens=1, temperature=0.0, repetition_penalty=5.0)
    gen_params = params(request)
    windowed = replace(gen_params, penalties=replace(gen_params.penalties, window=1))
    ids = model.codec.request_ids(request)
    gen = Generation(ids, windowed, model.codec, (), 512)
    logits = torch.zeros(model.cfg.vocab)
    gen.accept(logits.clone())  # sizes counts and seen
    assert gen._recent().nonzero().flatten().tolist() == [gen.tokens[-1]]


@pytest.mark.slow  # a ring of two node processes
def test_seeded_default_sampling_on_a_ring_equals_one_process(tiny_store, tmp_path):
    model = ReferenceModel(tiny_store)
    expected = tokens(model, GenerateRequest(PROMPT, raw=True, max_tokens=24, temperature=None, seed=11))
    with local_ring(tiny_store, 2, tmp_path, windows=[4, 4]) as local:
        got, done = collect(local.addresses[0], PROMPT, 24, raw=True, temperature=None, seed=11)
    assert got == expected and done.finish_reason in ("length", "stop")
