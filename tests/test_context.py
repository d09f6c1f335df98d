"""The model's whole context: the default budget keeps room for one request at its full length, and a request the
ring's KV budgets cannot hold is refused before it starts, with the numbers (unit maths, then a real ring of the
tiny synthetic model, whose context is 512 positions)."""

import asyncio
import dataclasses

import grpc
import pytest
import torch

from nodes.engine.budget import shard_budget
from nodes.engine.fused import kv_bytes
from nodes.engine.prefetch import KV_RESERVE_TOKENS
from nodes.errors import Rejected
from nodes.ring.admit import KvLedger
from prima_rpc.app import ring
from prima_rpc.client import PrimaClient, PrimaError, Token
from prima_rpc.spec.shapes import PRESETS
from prima_rpc.spec.windows import Windows
from solver.kv_term import kv_tokens
from tests.rings import collect, greedy_tokens

LONG = dataclasses.replace(PRESETS["tiny"], max_seq_len=8192)  # a context longer than KV_RESERVE_TOKENS
ALL = Windows(((0, 8),), 8, True)


@pytest.mark.parametrize("default, positions", [(True, 8192), (False, KV_RESERVE_TOKENS)])
def test_the_default_budget_reserves_the_whole_context(default, positions):
    plan = shard_budget(LONG, ALL, torch.float32, None, None, 1, True, 0, default_budget=default).plan
    head_and_kv = plan.fixed_bytes
    other = shard_budget(LONG, ALL, torch.float32, None, None, 1, True, 0, default_budget=not default).plan
    # the default budget also keeps room for one layer's read beside what it holds (nodes/engine/budget.py)
    one_layer = sum(plan.unit_bytes[0].values())
    assert head_and_kv - other.fixed_bytes == (1 if default else -1) * (kv_bytes(
        LONG, torch.float32, 8, 8192 - KV_RESERVE_TOKENS) + one_layer)
    assert plan.budget >= head_and_kv >= kv_bytes(LONG, torch.float32, 8, positions)  # raised to hold it


def test_the_ledger_refuses_with_the_numbers_and_frees_on_release():
    kv = KvLedger()
    kv.rooms = {"head:1": 0, "b:2": 1000, "c:3": 600}  # 0: no limit there
    kv.admit("a", 100, 500)
    with pytest.raises(Rejected) as err:
        kv.admit("x", 400, 700)  # more than node c holds at all
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert all(s in str(err.value) for s in ("700 KV positions", "400 tokens", "max_tokens 300", "c:3", "600"))
    with pytest.raises(Rejected) as err:
        kv.admit("y", 50, 200)  # fits alone, not beside a's 500
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "100 KV positions free of 600" in str(err.value)
    kv.release("a")
    kv.admit("y", 50, 200)
    assert kv.held == {"y": 200}


# ---------------------------------------------------------------- a real 3-node ring


@pytest.fixture(scope="module")
def head(tiny_rings) -> str:
    return tiny_rings(3, [3, 3, 2]).addresses[0]


def frames(head: str) -> list[int]:
    return [info.stats.frames for _, info in ring.walk(head)]


@pytest.mark.slow
def test_a_prompt_of_the_whole_context_runs_on_the_default_ring(head, tiny_store):
    context = PRESETS["tiny"].max_seq_len
    prompt = ("The ring holds it all. " * 40)[:context - 1]  # one token a byte: the last position is the answer's
    tokens, done = collect(head, prompt, 4, raw=True)
    assert done.prompt_tokens == context - 1 and done.max_tokens == 1
    assert tokens == greedy_tokens(tiny_store, prompt, 1, raw=True)
    before = frames(head)
    with pytest.raises(PrimaError) as err:
        collect(head, prompt + "!", 4, raw=True)  # one position more than the context holds
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"context is {context}" in err.value.message
    assert frames(head) == before  # refused before any prefill


@pytest.mark.slow
def test_a_request_beside_others_that_cannot_fit_is_refused_at_once(tiny_rings):
    # a budget below the minimum runs at it: weights and head, and the reserve (the whole context, 512) for KV (the
    # ring of tests/test_prefix_cache_ring.py)
    head = tiny_rings(3, [3, 3, 2], extra_args=[["--mem-budget", "1", "--prefix-disk", "0"]] * 3).addresses[0]
    assert [info.kv_positions for _, info in ring.walk(head)] == [PRESETS["tiny"].max_seq_len] * 3

    async def main():
        async with PrimaClient(head) as client:
            first = client.generate("a" * 8, raw=True, max_tokens=500, speculate="off")
            assert isinstance(await anext(first), Token)  # it holds 508 positions on every node now
            with pytest.raises(PrimaError) as err:
                async for _ in client.generate("b" * 300, raw=True, max_tokens=200):
                    pass
            rest = [e async for e in first]
            return err.value, rest

    err, rest = asyncio.run(main())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "needs 500 KV positions" in err.message
    assert "free of" in err.message and rest[-1].completion_tokens == 500
    assert collect(head, "b" * 300, 200, raw=True)[1].completion_tokens > 0  # room again once it ended


def test_the_plan_prices_every_request_asked_for_at_the_whole_context():
    assert kv_tokens(512) == 512 and kv_tokens(8192, 4) == 32768
    with pytest.raises(ValueError, match="concurrency"):
        kv_tokens(512, 0)
