"""A seeded sampled request (temperature > 0, seed) resumed on a new head continues its own sample stream also with
speculation on: each output position draws from its own generator (the seed and the position alone), so what was
drafted, and where the new head's steps begin, change nothing. Single process on a tiny model, and a real ring whose
head is SIGKILLed mid-stream."""

import asyncio

import pytest

from nodes.generation.reference import ReferenceModel
from nodes.generation.sampling import SamplingParams
from nodes.generation.speculate import SpeculateParams
from nodes.generation.state import GenerateParams, Generation
from tests.rings import local_ring
from tests.test_failover import stream_and_kill

# a prompt that repeats itself, so prompt lookup (ngram) drafts often
PROMPT = "one two three four, one two three four, one two three four, one two three four, one two"
SAMPLING = SamplingParams(temperature=0.3, top_k=40, seed=2)


def tokens_of(model: ReferenceModel, prompt_ids: list[int], params: GenerateParams,
              resume: list[int] = ()) -> tuple[list[int], int]:
    """The reference's loop over one Generation, resumed after `resume` as a new head resumes it (prompt and tokens
    replayed into a fresh KV cache); its tokens and how many were drafted."""
    gen = Generation(prompt_ids, params, model.codec, model.store.manifest.eos_token_ids, model.cfg.max_seq_len,
                     None, model.cfg.vocab)
    gen.resume(list(resume), model.cfg.vocab)
    cache = model.new_cache(gen.capacity)
    if gen.tokens:
        model.step_all(gen.prompt_ids + gen.tokens[:-1], 0, cache)
    while not gen.done:
        ids, pos = gen.pending()
        if draft := gen.draft():
            gen.accept_draft(model.step_all(ids + draft, pos, cache), draft)
        else:
            gen.accept(model.step(ids, pos, cache))
    return gen.tokens, gen.spec.drafted


@pytest.mark.parametrize("at", [1, 9, 30])
def test_a_seeded_stream_resumed_with_speculation_goes_on_with_its_own_samples(tiny_store, at):
    model = ReferenceModel(tiny_store)
    ids = model.codec.prompt_ids(PROMPT, raw=True)
    plain = GenerateParams(max_tokens=60, sampling=SAMPLING)
    spec = GenerateParams(max_tokens=60, sampling=SAMPLING, speculate=SpeculateParams("ngram", 4))
    whole, _ = tokens_of(model, ids, plain)
    drafted_whole, drafted = tokens_of(model, ids, spec)
    assert drafted >= 5  # speculation ran (and its drafts were verified against the samples)
    assert drafted_whole == whole  # the same samples with speculation on as off
    resumed, _ = tokens_of(model, ids, spec, resume=whole[:at])
    assert resumed == whole
    other, _ = tokens_of(model, ids, GenerateParams(max_tokens=60, sampling=SamplingParams(0.3, 40, seed=3)))
    assert other != whole  # the seed is what fixes the stream


@pytest.mark.slow
def test_the_head_killed_mid_stream_of_a_seeded_speculated_request_resumes_its_samples(smol_store, tmp_path):
    model = ReferenceModel(smol_store)
    expected, _ = tokens_of(model, model.codec.prompt_ids(PROMPT), GenerateParams(max_tokens=48, sampling=SAMPLING))
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        tokens, _ = asyncio.run(stream_and_kill(local.addresses, PROMPT, 48, local.processes[0], after=2,
                                                temperature=0.3, top_k=40, seed=2, speculate="ngram"))
    assert tokens == expected
