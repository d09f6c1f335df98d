"""The request state machine and the sampler, on the tiny synthetic model's byte tokenizer."""

import pytest
import torch

from nodes.engine.store import LayerStore
from nodes.generation.sampling import Sampler, SamplingParams
from nodes.generation.state import GenerateParams, Generation
from nodes.generation.text import PromptError, TextCodec


@pytest.fixture(scope="module")
def codec(tiny_store):
    store = LayerStore(tiny_store)
    return TextCodec(store.manifest, store.tokenizer_path())


def one_hot(token: int, vocab: int = 320) -> torch.Tensor:
    logits = torch.zeros(vocab)
    logits[token] = 10.0
    return logits


def feed(gen: Generation, text: str, codec: TextCodec) -> str:
    out = ""
    for token in codec.encode(text):
        if gen.done:
            break
        out += gen.accept(one_hot(token)).text
    return out


def test_chat_template_and_byte_tokens_round_trip(codec):
    ids = codec.prompt_ids("héllo")
    assert ids[0] == 1  # <|im_start|>
    assert codec.decode(ids).endswith("user\nhéllo\nassistant\n")


def test_pending_feeds_prompt_then_last_token(codec):
    gen = Generation([5, 6, 7], GenerateParams(max_tokens=3), codec, (2,), 64)
    assert gen.pending() == ([5, 6, 7], 0)
    gen.accept(one_hot(9))
    assert gen.pending() == ([9], 3)


def test_length_limit_and_eos(codec):
    gen = Generation([5], GenerateParams(max_tokens=2), codec, (2,), 64)
    gen.accept(one_hot(40))
    gen.accept(one_hot(41))
    assert gen.done and gen.finish_reason == "length" and gen.tokens == [40, 41]
    gen = Generation([5], GenerateParams(max_tokens=5), codec, (2,), 64)
    gen.accept(one_hot(2))
    assert gen.finish_reason == "stop" and gen.tokens == [2]


def test_context_caps_max_tokens_and_rejects_long_prompts(codec):
    assert Generation([5] * 60, GenerateParams(max_tokens=100), codec, (2,), 64).max_tokens == 4
    with pytest.raises(PromptError, match="context is 64"):
        Generation([5] * 64, GenerateParams(), codec, (2,), 64)
    with pytest.raises(PromptError, match="empty"):
        Generation([], GenerateParams(), codec, (2,), 64)


def test_stop_string_ends_text_before_it_and_holds_back_prefixes(codec):
    gen = Generation([5], GenerateParams(max_tokens=50, stop=("END",)), codec, (2,), 64)
    pieces = []
    for t in codec.encode("abc ENxEND tail"):
        if not gen.done:
            pieces.append(gen.accept(one_hot(t)).text)
    assert gen.finish_reason == "stop"
    assert gen.text == "abc ENx"
    assert "" in pieces  # "EN" was held back until it turned out not to be a stop string


def test_multibyte_characters_stream_whole(codec):
    gen = Generation([5], GenerateParams(max_tokens=20), codec, (2,), 64)
    assert feed(gen, "é€", codec) == "é€"


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(stop=("",))])
def test_bad_params_are_rejected(bad):
    with pytest.raises(ValueError):
        GenerateParams(**bad)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=1.5)])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_sampling_is_reproducible_per_seed_and_respects_top_k_and_top_p():
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0])

    def draw(params):
        sampler = Sampler(params)
        return [sampler(logits) for _ in range(50)]

    assert draw(SamplingParams(1.0, seed=3)) == draw(SamplingParams(1.0, seed=3))
    assert set(draw(SamplingParams(2.0, top_k=2, seed=1))) <= {0, 1}
    # p(0)=0.51, p(1)=0.31: top_p=0.6 keeps exactly those two
    assert set(draw(SamplingParams(1.0, top_p=0.6, seed=1))) == {0, 1}
    assert set(draw(SamplingParams(0.0))) == {0}


def test_greedy_draws_the_first_of_equal_maxima_and_a_nan_as_torch_argmax_does():
    for logits in ([1.0, 3.0, 3.0, 0.0], [1.0, float("nan"), 3.0, float("nan")], [float("-inf")] * 3 + [-1.0]):
        t = torch.tensor(logits)
        assert Sampler(SamplingParams())(t) == int(t.argmax()), logits
