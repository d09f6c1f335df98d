"""Speculative decoding in the single process: prompt lookup, greedy equality with plain decoding (also through
many rejections), and the rejection rule's output distribution (chi-square on the tiny model)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from nodes.engine.store import LayerStore
from nodes.errors import Rejected
from nodes.generation.draft import DraftModel, load_draft
from nodes.generation.head_step import RowLogits
from nodes.generation.reference import ReferenceModel
from nodes.generation.sampling import Sampler, SamplingParams
from nodes.generation.speculate import PromptLookup, SpeculateParams, Speculator
from nodes.generation.state import GenerateParams
from nodes.generation.text import TextCodec

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "List three prime numbers."]
REPEAT = ("Repeat this text exactly: the quick brown fox jumps over the lazy dog while the cat sleeps on the "
          "warm mat by the door.")
NGRAM = SpeculateParams("ngram", 4)


@pytest.mark.parametrize("context, n, expected", [
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),        # longest suffix [1, 2, 3] found earlier
    ([1, 2, 5, 2, 7, 1, 2], 3, [5, 2, 7]),     # suffix [1, 2]
    ([4, 2, 8, 2, 6, 4, 2], 1, [8]),           # suffix [4, 2]: the only earlier match
    ([5, 2, 7, 5, 2, 6, 5, 2], 1, [6]),        # suffix [5, 2]: its latest earlier match wins
    ([4, 2, 8, 2, 6, 2], 1, []),               # a one-token suffix [2] is no evidence
    ([1, 2, 3], 4, []),                        # nothing repeats
    ([1, 2, 1, 2], 0, []),
])
def test_prompt_lookup(context, n, expected):
    assert PromptLookup()(context, n) == expected


def scan(context: list[int], n: int) -> list[int]:
    """Prompt lookup by its definition: search back from the end for the longest suffix of 3, then 2 tokens."""
    for g in range(min(3, len(context) - 1), 1, -1):
        for start in range(len(context) - g - 1, -1, -1):
            if context[start:start + g] == context[-g:]:
                return context[start + g:start + g + n]
    return []


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 4), min_size=1, max_size=8))
def test_indexed_lookup_equals_the_scan_as_the_context_grows(tokens, steps):
    lookup, end = PromptLookup(), 0
    for step in steps:  # the context grows by a few tokens a trip, as accepted tokens are appended
        end += step
        assert lookup(tokens[:end], 4) == scan(tokens[:end], 4), tokens[:end]
    assert lookup(tokens[:end // 2] + [9, 9, 9], 2) == scan(tokens[:end // 2] + [9, 9, 9], 2)  # not an extension


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="speculate"):
        SpeculateParams("magic")
    with pytest.raises(ValueError, match="draft_tokens"):
        SpeculateParams("ngram", 0)


def test_draft_length_follows_the_acceptance_rate():
    spec = Speculator(SpeculateParams("ngram", 8))
    assert spec.length() == 8
    for _ in range(4):
        spec.update(8, 0)
    assert spec.length() == 1
    for _ in range(6):
        spec.update(1, 1)
    assert spec.length() == 8


def run(model, prompt, max_tokens, speculate=SpeculateParams(), raw=False):
    spec = Speculator(speculate)
    params = GenerateParams(max_tokens=max_tokens, speculate=speculate)
    tokens = [t.token_id for t in model.generate(prompt, params, raw, spec)]
    return tokens, spec


@pytest.fixture(scope="module")
def smol(smol_store):
    return ReferenceModel(smol_store)


@pytest.mark.slow
def test_greedy_speculation_equals_plain_decoding(smol):
    total = Speculator(NGRAM)
    for prompt in PROMPTS + [REPEAT]:
        plain, _ = run(smol, prompt, 32)
        fast, spec = run(smol, prompt, 32, NGRAM)
        assert fast == plain, prompt
        total.update(spec.drafted, spec.accepted)
    assert total.accepted > 0 and total.accepted < total.drafted  # both paths taken


def test_many_rejections_leave_no_trace(tiny_store):
    """A random tiny model: prompt lookup guesses mostly wrong, so the KV rows of rejected drafts are written
    over again and again; tokens still equal plain decoding."""
    model = ReferenceModel(tiny_store)
    prompt = "abcabcabdabcabxyzabc" * 3
    plain, _ = run(model, prompt, 400, raw=True)
    fast, spec = run(model, prompt, 400, SpeculateParams("ngram", 6), raw=True)
    assert fast == plain
    assert spec.drafted - spec.accepted >= 20, (spec.drafted, spec.accepted)


def histogram(tokens: list[int], probs: torch.Tensor, min_expected: float = 5.0):
    """Observed and expected counts, tokens with small expectation pooled into one bin."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    big = probs * n >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([probs[big].double() * n, (probs[~big].double() * n).sum().view(1)])
    return obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()


@pytest.mark.parametrize("which", ["likely", "unlikely"])
def test_rejection_sampling_keeps_the_target_distribution(tiny_store, which):
    """The first token a verification emits, and the second given the first was the accepted draft, follow the
    target model's own distributions (chi-square, fixed seed), whether the draft is likely or not."""
    model = ReferenceModel(tiny_store)
    context = model.codec.encode("the cat sat on the")
    cache = model.new_cache(64)
    model.step(context, 0, cache)
    sampler = Sampler(SamplingParams(temperature=0.3, seed=7))
    p0 = sampler.probs(model.step(context, 0, model.new_cache(64)))
    x = int(p0.argmax()) if which == "likely" else int(p0.argmin())
    y = int(p0.argsort()[-2])
    logits = model.step_all(context[-1:] + [x, y], len(context) - 1, cache)
    p1 = sampler.probs(logits[1])
    first, second = [], []
    for _ in range(20000):
        out = sampler.verify(logits, [x, y])
        first.append(out[0])
        if out[0] == x:
            second.append(out[1])
    checks = [(first, p0)] + ([(second, p1)] if which == "likely" else [])
    for tokens, p in checks:
        obs, exp = histogram(tokens, p)
        assert len(obs) > 5
        assert chisquare(obs, exp).pvalue > 1e-3, which
    if which == "likely":
        assert len(second) > 2000  # the draft was accepted often enough to test what follows it
    else:
        assert len(second) < 200  # the rejection path was what ran


@pytest.mark.parametrize("draft", ["same", "other"])
def test_a_draft_model_gives_the_targets_tokens(tiny_store, tiny_qwen_store, draft):
    """A draft model of the same tokenizer: the target itself (drafts nearly all accepted) or another model
    (mostly rejected); either way the greedy tokens are the target's own."""
    model = ReferenceModel(tiny_store)
    drafter = DraftModel(model if draft == "same" else ReferenceModel(tiny_qwen_store))
    params = SpeculateParams("draft", 4)
    plain, _ = run(model, "The quick brown fox", 60, raw=True)
    spec = Speculator(params, drafter)
    fast = [t.token_id for t in model.generate("The quick brown fox", GenerateParams(max_tokens=60, speculate=params),
                                               True, spec)]
    assert fast == plain
    if draft == "same":
        assert spec.accepted >= 0.9 * spec.drafted > 0
    else:
        assert spec.drafted - spec.accepted >= 20


def test_draft_mode_needs_a_draft_model():
    with pytest.raises(ValueError, match="needs a draft model"):
        Speculator(SpeculateParams("draft", 4))


def test_a_draft_of_another_tokenizer_is_refused(smol_store, tiny_store, tiny_qwen_store):
    """The tiny synthetic stores share a byte-level tokenizer; SmolLM2 has its own 49,152 tokens."""
    smol = LayerStore(smol_store)
    target = TextCodec(smol.manifest, smol.tokenizer_path())
    with pytest.raises(Rejected, match=rf"the draft model synthetic-tiny \({tiny_store}\) does not share the "
                                       rf"tokenizer of {smol.manifest.name}: 259 vs 49152 tokens") as err:
        load_draft(tiny_store, target)
    assert "\n" not in str(err.value) and err.value.code.name == "FAILED_PRECONDITION"
    with pytest.raises(Rejected, match="is not a layer store"):
        load_draft(tiny_store / "missing", target)
    same = ReferenceModel(tiny_store).codec
    assert load_draft(tiny_qwen_store, same).cfg.n_layers > 0


def test_verify_projects_no_row_after_the_first_rejection(tiny_store):
    """The head's verify rows are projected as the verification reads them: a draft whose first token is wrong
    costs one lm-head product, not four; an accepted draft reads every row; the tokens are the plain step's."""
    model = ReferenceModel(tiny_store)
    context = model.codec.encode("the cat sat on the")
    cache = model.new_cache(64)
    model.step(context[:-1], 0, cache)
    target = int(model.step(context, 0, model.new_cache(64)).argmax())
    h = model.hidden(context[-1:] + [target, target, target], len(context) - 1, cache)

    def logits_of(hidden):
        return model.head.logits(hidden[-1:], model.cfg.norm_eps)[0]

    wrong = (target + 1) % model.cfg.vocab
    rows = RowLogits(logits_of, h, 4)
    assert Sampler(SamplingParams()).verify(rows, [wrong, wrong, wrong]) == [target]
    assert rows.projected == 1
    rows = RowLogits(logits_of, h, 4)
    out = Sampler(SamplingParams()).verify(rows, [target, target, target])
    assert rows.projected == len(out) and out[0] == target
    assert out == Sampler(SamplingParams()).verify(torch.stack([logits_of(h[:i + 1]) for i in range(4)]),
                                                   [target] * 3)
