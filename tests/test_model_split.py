"""Running layers [0, a) then [a, L) equals running [0, L) exactly in fp32, and chunked prefill
equals whole prefill."""

import pytest
import torch

from nodes.generation.reference import ReferenceModel

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]


@pytest.fixture(scope="module", params=["tiny_store", "tiny_qwen_store", "smol_store"])
def model(request):
    return ReferenceModel(request.getfixturevalue(request.param))


def test_split_points_equal_the_whole(model):
    ids = [i % model.cfg.vocab for i in PROMPT]
    n = model.cfg.n_layers
    whole = model.hidden(ids, 0, model.new_cache(32))
    for cuts in ([1], [n // 2], [n - 1], [1, 2, n - 1], list(range(1, n))):
        cache, bounds = model.new_cache(32), [0, *cuts, n]
        x = model.head.embed_tokens(torch.tensor(ids))
        for start, stop in zip(bounds, bounds[1:]):
            x = model.hidden(ids, 0, cache, start, stop, x=x)
        assert torch.equal(x, whole), f"split at {cuts} differs"


def test_decode_after_split_prefill_equals_whole(model):
    ids = [i % model.cfg.vocab for i in PROMPT]
    n = model.cfg.n_layers
    whole_cache, split_cache = model.new_cache(32), model.new_cache(32)
    model.hidden(ids, 0, whole_cache)
    x = model.head.embed_tokens(torch.tensor(ids))
    model.hidden(ids, 0, split_cache, 0, n, x=x)
    nxt = [ids[3]]
    a = model.hidden(nxt, len(ids), whole_cache)
    y = model.hidden(nxt, len(ids), split_cache, 0, n // 2)
    b = model.hidden(nxt, len(ids), split_cache, n // 2, n, x=y)
    assert torch.equal(a, b)


def test_chunked_prefill_matches_one_shot(model):
    ids = [i % model.cfg.vocab for i in PROMPT]
    one = model.hidden(ids, 0, model.new_cache(32))
    cache = model.new_cache(32)
    first = model.hidden(ids[:6], 0, cache)
    rest = model.hidden(ids[6:], 6, cache)
    # Different matmul shapes round differently: allow float32 noise relative to the activations' scale.
    scale = one.abs().max().item()
    torch.testing.assert_close(torch.cat([first, rest]), one, rtol=1e-4, atol=1e-5 * scale)
