"""Resident compute of a mixture of experts: rows grouped by expert, each chosen expert run once a step, rows routed
to no expert costing nothing; batched rows give each row its own result; a 3-node ring (k = 2) equals the single
process, one request and several at once."""

import pytest
import torch

from nodes.engine.loading import read_layer
from nodes.engine.moe import Expert, moe_mlp, route
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.windows import Windows
from tests.rings import collect, collect_all, greedy_reference, local_ring
from tools.synth import synth

ACT = torch.nn.functional.silu


@pytest.fixture(scope="module", params=["tiny-qwen3moe", "tiny-qwen2moe"])
def store(request, tmp_path_factory):
    return synth(tmp_path_factory.mktemp("moe") / request.param, request.param, seed=4)


class Counted(Expert):
    """A real expert that counts the rows it is run over, call by call."""

    def __init__(self, expert: Expert):
        super().__init__(expert.w_gate_up, expert.w_down)
        self.calls: list[int] = []

    def __call__(self, x, act):
        self.calls.append(x.shape[0])
        return super().__call__(x, act)


def test_each_chosen_expert_runs_once_over_its_rows_and_the_others_not_at_all(store):
    s = LayerStore(store)
    moe = read_layer(s, 2, s.config, torch.float32, None).moe
    moe.experts = {e: Counted(x) for e, x in moe.experts.items()}
    x = torch.randn(12, s.config.hidden)
    out = moe_mlp(x, moe, ACT)
    _, chosen = route(x, moe.router, moe.top_k, moe.norm_topk)
    for e, expert in moe.experts.items():
        rows = int((chosen == e).any(dim=1).sum())
        assert expert.calls == ([rows] if rows else []), e
    assert sum(sum(e.calls) for e in moe.experts.values()) == 12 * moe.top_k
    # the batch's rows each get what the row alone gets
    alone = torch.cat([moe_mlp(x[i:i + 1], moe, ACT) for i in range(12)])
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-6)


def test_router_weights_follow_the_config(store):
    s = LayerStore(store)
    moe = read_layer(s, 0, s.config, torch.float32, None).moe
    x = torch.randn(5, s.config.hidden)
    weights, chosen = route(x, moe.router, moe.top_k, moe.norm_topk)
    probs = torch.softmax(x @ moe.router.T, dim=-1)
    assert torch.equal(chosen, probs.topk(moe.top_k).indices)
    sums = weights.sum(dim=-1)
    if s.config.norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones(5))
    else:
        assert (sums < 1).all()
        torch.testing.assert_close(weights, probs.topk(moe.top_k).values)


def test_a_budget_below_the_dense_parts_and_top_k_experts_is_refused_clearly(store):
    s = LayerStore(store)
    with pytest.raises(StoreError, match=r"6 mixture-of-experts layers. dense parts and 2 experts"):
        Shard(s, Windows(((0, 6),), 6, True), torch.float32, budget=1 << 20)


@pytest.mark.slow
def test_a_three_node_ring_equals_the_single_process(store, tmp_path):
    prompts = ["The capital of France is", "one two three", "a"]
    expected = greedy_reference(store, prompts, 8)
    with local_ring(store, 3, tmp_path / "logs", [1, 1, 1]) as local:  # six layers: k = 2
        assert collect(local.addresses[0], prompts[0], 8)[0] == expected[prompts[0]]
        results = collect_all(local.addresses[0], prompts, 8)  # decoded in batches
        assert [tokens for tokens, _ in results] == [expected[p] for p in prompts]


def test_batched_prefill_equals_each_alone(store):
    model = ReferenceModel(store)
    shard = Shard(LayerStore(store), Windows(((0, 6),), 6, True), torch.float32)
    prompts = [[1, 5, 9, 30, 77], [4, 8], [100, 3, 3, 60]]
    caches = [shard.cache_for(str(i), 0, 16, len(p)) for i, p in enumerate(prompts)]
    batch, _ = shard.compute_batch([(shard.embed(p), c, 0) for p, c in zip(prompts, caches)], 0)
    for p, h in zip(prompts, batch):
        alone = model.hidden(p, 0, model.new_cache(16))
        torch.testing.assert_close(h, alone, rtol=1e-5, atol=1e-5)
