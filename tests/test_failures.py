"""A node lost mid-generation (SIGKILL, or SIGSTOP: hung) is detected by the head within seconds; the
ring is re-planned on the survivors and the stream completes with the undisturbed greedy tokens."""

import asyncio
import os
import signal
import time

import pytest

from nodes.generation import GenerateParams
from nodes.reference import ReferenceModel
from prima_rpc import ring
from prima_rpc.client import Finished, PrimaClient, PrimaError, Token
from prima_rpc.local_ring import launch

pytestmark = pytest.mark.slow
PROMPT = "Write a short story about a lighthouse keeper."
TOKENS = 64


@pytest.fixture(scope="module")
def expected(smol_store):
    model = ReferenceModel(smol_store)
    return [t.token_id for t in model.generate(PROMPT, GenerateParams(max_tokens=TOKENS))]


async def generate_and_break(address: str, victim_pid: int, sig: int, after: int):
    tokens, stamps, done = [], [], None
    async with PrimaClient(address) as client:
        async for event in client.generate(PROMPT, max_tokens=TOKENS):
            if isinstance(event, Token):
                tokens.append(event.token_id)
                stamps.append(time.monotonic())
                if len(tokens) == after:
                    os.kill(victim_pid, sig)
                    broke = time.monotonic()
            else:
                done = event
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return tokens, done, broke, max(gaps)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_worker_lost_mid_generation_resumes_with_the_same_tokens(smol_store, expected, tmp_path, sig):
    local = launch(smol_store, 3, log_dir=tmp_path, detach=False)
    try:
        ring.start(local.addresses[0], [10, 10, 10])
        tokens, done, _, longest_gap = asyncio.run(
            generate_and_break(local.addresses[0], local.processes[1].pid, sig, after=8))
        assert isinstance(done, Finished)
        assert tokens == expected[:len(tokens)] and len(tokens) == len(expected)
        assert longest_gap < 10, f"the stream stalled {longest_gap:.1f} s"
        nodes = ring.walk(local.addresses[0])
        assert [a for a, _ in nodes] == [local.addresses[0], local.addresses[2]]
        assert [i.role for _, i in nodes] == ["head", "worker"]
    finally:
        if sig == signal.SIGSTOP:
            os.kill(local.processes[1].pid, signal.SIGCONT)
        local.stop()


def test_unrecoverable_loss_ends_the_request_quickly_naming_the_node(tiny_store, tmp_path):
    # The head's disk holds only its own windows' files, so it cannot take over the lost worker's layers.
    partial = tmp_path / "head-store"
    partial.mkdir()
    for f in tiny_store.iterdir():
        if not f.name.startswith("layer_") or int(f.stem.split("_")[1]) >= 4:
            os.link(f, partial / f.name)
    local = launch(None, 2, log_dir=tmp_path, detach=False, models=[partial, tiny_store])
    try:
        ring.start(local.addresses[0], [4, 4])  # node1 holds [0, 4), the head [4, 8)

        async def run():
            async with PrimaClient(local.addresses[0]) as client:
                async for event in client.generate("tell me", raw=True, max_tokens=400):
                    if isinstance(event, Token) and event.index == 4:
                        os.kill(local.processes[1].pid, signal.SIGKILL)

        start = time.monotonic()
        with pytest.raises(PrimaError) as err:
            asyncio.run(run())
        assert time.monotonic() - start < 10
        assert err.value.code.name == "UNAVAILABLE"
        assert local.addresses[1] in err.value.message and "cannot take over" in err.value.message
    finally:
        local.stop()
