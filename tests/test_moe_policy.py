"""Expert cache policies as tables: whom each evicts, and the hit rate each gives on a routing trace."""

import pytest

from nodes.engine.expert_policy import LRU, Frequency, RouterHistory, hit_rate, warm_keys


def used(policy, *steps):
    for layer, experts in steps:
        policy.use(layer, experts)
    return policy


@pytest.mark.parametrize(("policy", "victims"), [
    # used: 1 then 2 three times then 3; 0 never since load
    (LRU(), [(0, 0), (0, 1), (0, 2)]),
    (Frequency(), [(0, 0), (0, 1), (0, 3)]),  # 1 and 3 once each: the older first; 2 (three times) last
    (RouterHistory(window=1), [(0, 0), (0, 1), (0, 2)]),  # the last step: 2 and 3 once each, 1 forgotten
])
def test_whom_each_policy_evicts_first(policy, victims):
    used(policy, (0, (1,)), (0, (2,)), (0, (2,)), (0, (2, 3)))
    held = {(0, e) for e in range(4)}
    assert policy.victims(held, 3) == victims
    assert policy.victims(held, 0) == []


def test_only_held_experts_are_victims():
    policy = used(LRU(), (0, (1,)), (1, (1,)))
    assert policy.victims({(1, 1), (0, 5)}, 5) == [(0, 5), (1, 1)]


def test_the_cache_is_warmed_with_experts_in_turn_from_every_layer():
    assert warm_keys([3, 4], 2) == [(3, 0), (4, 0), (3, 1), (4, 1)]


def test_hit_rate_on_a_trace():
    # one layer, 4 experts, room for 2 (warm: 0, 1); each step chooses 2
    trace = [(0, (0, 2)), (0, (0, 3)), (0, (0, 2)), (0, (2, 3))]
    # step1 held {0,1}: 0 hit -> {0,2}; step2: 0 hit, 3 miss -> {0,3}; step3: 0 hit, 2 miss -> {0,2};
    # step4: 2 hit, 3 miss -> {2,3}
    assert hit_rate(trace, [0], 4, 2, LRU()) == 4 / 8
    # room for 3 (warm: 0, 1, 2): only 3 misses, once; the never used 1 makes room for it
    assert hit_rate(trace, [0], 4, 3, LRU()) == 7 / 8
    assert hit_rate([], [0], 4, 2, LRU()) == 0.0


def test_frequency_keeps_a_popular_expert_that_lru_drops():
    # expert 0 every third step, 1..4 in turn between: with room for two, LRU has evicted 0 by its next use (its
    # only hits: the warm 0 and 1 at the start), frequency and router history keep it after its second use
    trace = [(0, (0,)), (0, (1,)), (0, (2,)), (0, (0,)), (0, (3,)), (0, (4,))] * 4
    rates = [hit_rate(trace, [0], 5, 2, policy()) for policy in (LRU, Frequency, RouterHistory)]
    assert rates == [2 / 24, 8 / 24, 8 / 24]
