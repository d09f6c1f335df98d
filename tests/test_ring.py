"""Real prima-node processes on loopback: every ring shape gives the reference's greedy tokens."""

import asyncio

import grpc
import pytest

from prima_rpc.app import ring
from prima_rpc.client import PrimaClient, PrimaError, SyncClient, Token
from prima_rpc.control import Control, assign_request
from tests.rings import collect, collect_all, greedy_reference

pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "List three prime numbers."]
TOKENS = 16


@pytest.fixture(scope="module")
def reference(smol_store):
    return greedy_reference(smol_store, PROMPTS, TOKENS)


@pytest.mark.parametrize("windows", [
    [30],             # one node holds everything
    [10, 10, 10],     # 3 nodes, k = 1
    [7, 3, 5],        # 3 nodes, uneven windows, k = 2
    [10, 10, 0, 10],  # 4 nodes, one relay
    [3, 2],           # 2 nodes, k = 6: each node's share is split across six rounds
], ids=lambda w: ",".join(map(str, w)))
def test_ring_shape_equals_reference(rings, reference, windows):
    local = rings(len(windows))
    nodes = ring.start(local.addresses[0], windows)
    assert [info.role for _, info in nodes] == ["head"] + ["relay" if w == 0 else "worker" for w in windows[1:]]
    for prompt in PROMPTS:
        tokens, done = collect(local.addresses[0], prompt, TOKENS)
        assert tokens == reference[prompt], f"windows {windows}, prompt {prompt!r}"
        assert done.completion_tokens == len(tokens) and done.finish_reason in ("length", "stop")
    # Every request released its KV cache on every node.
    assert all(info.stats.active_requests == 0 for _, info in ring.walk(local.addresses[0]))


def test_concurrent_requests_do_not_mix(rings, reference):
    local = rings(3, [10, 10, 10])
    results = collect_all(local.addresses[0], PROMPTS + PROMPTS[:1], TOKENS)
    for prompt, (tokens, _) in zip(PROMPTS + PROMPTS[:1], results):
        assert tokens == reference[prompt]


def test_sync_client_and_seeded_sampling_repeat(rings):
    local = rings(3, [10, 10, 10])
    with SyncClient(local.addresses[0]) as client:
        runs = [[e.token_id for e in client.generate(PROMPTS[1], max_tokens=8, temperature=0.8, seed=11)
                 if isinstance(e, Token)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 8


@pytest.mark.parametrize("kwargs, code, message", [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be"),
    (dict(prompt="hi", max_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be"),
    (dict(prompt="hi", top_p=3.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt="hi", raw=True, stop=("",)), grpc.StatusCode.INVALID_ARGUMENT, "non-empty"),
])
def test_bad_generate_requests_get_a_clear_status(rings, kwargs, code, message):
    local = rings(3, [10, 10, 10])

    async def call():
        async with PrimaClient(local.addresses[0]) as client:
            prompt = kwargs.pop("prompt")
            async for _ in client.generate(prompt, **kwargs):
                pass

    with pytest.raises(PrimaError) as err:
        asyncio.run(call())
    assert err.value.code == code and message in err.value.message


def test_generate_on_a_worker_is_refused(rings):
    local = rings(3, [10, 10, 10])
    with pytest.raises(PrimaError) as err:
        collect(local.addresses[1], "hi", TOKENS)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "not the ring's head" in err.value.message


def test_a_removed_device_is_routed_around(rings, reference):
    """A plan's removed device leaves the ring: its predecessor sends to its successor, it holds nothing."""
    local = rings(4)
    addresses = local.addresses
    try:
        nodes = ring.start(addresses[0], [10, 0, 10, 10], members=[True, False, True, True])
        assert [a for a, _ in nodes] == [addresses[0], addresses[2], addresses[3]]
        tokens, _ = collect(addresses[0], PROMPTS[0], TOKENS)
        assert tokens == reference[PROMPTS[0]]
        with Control(addresses[1]) as peer:
            left = peer.info()
        assert left.role == "relay" and not left.windows and left.stats.resident_bytes == 0
        with pytest.raises(ring.RingError, match="cannot hold layers"):
            ring.start(addresses[0], [10, 10, 10], members=[True, False, True])
    finally:  # the module's 4-node ring goes back to its first wiring
        for i, address in enumerate(addresses):
            with Control(address) as peer:
                peer.set_peer(addresses[(i + 1) % 4])


@pytest.mark.parametrize("buffer", [-1.0, float("nan"), 1e9])
def test_a_bad_stream_buffer_is_refused(rings, buffer):
    local = rings(3)
    with Control(local.addresses[1]) as peer:
        info = peer.info()
        req = assign_request([(0, 10)], info.n_layers, info.model_id, 0, buffer_layers=buffer)
        with pytest.raises(grpc.RpcError) as err:
            list(peer.assign(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream_buffer_layers" in err.value.details()
