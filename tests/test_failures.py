"""A node lost mid-generation (SIGKILL, or SIGSTOP: hung) is detected by the head within seconds; the
ring is re-planned on the survivors and the stream completes with the undisturbed greedy tokens."""

import asyncio
import os
import signal
import time

import pytest

from prima_rpc.app import ring
from prima_rpc.client import Finished, PrimaClient, PrimaError, Token
from tests.rings import collect, greedy_tokens, local_ring, stream_and_signal

pytestmark = pytest.mark.slow
PROMPT = "Write a short story about a lighthouse keeper."
TOKENS = 64


@pytest.fixture(scope="module")
def expected(smol_store):
    return greedy_tokens(smol_store, PROMPT, TOKENS)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_worker_lost_mid_generation_resumes_with_the_same_tokens(smol_store, expected, tmp_path, sig):
    with local_ring(smol_store, 3, tmp_path, [10, 10, 10]) as local:
        victim = local.processes[1].pid
        try:
            tokens, done, longest_gap = asyncio.run(stream_and_signal(local.addresses[0], PROMPT, TOKENS, victim, sig,
                                                                      after=8))
            assert isinstance(done, Finished)
            assert tokens == expected[:len(tokens)] and len(tokens) == len(expected)
            assert longest_gap < 10, f"the stream stalled {longest_gap:.1f} s"
            nodes = ring.walk(local.addresses[0])
            assert [a for a, _ in nodes] == [local.addresses[0], local.addresses[2]]
            assert [i.role for _, i in nodes] == ["head", "worker"]
        finally:  # a stopped node is let go on before the ring stops
            if sig == signal.SIGSTOP:
                os.kill(victim, signal.SIGCONT)


def test_unrecoverable_loss_ends_the_request_quickly_naming_the_node(tiny_store, tmp_path):
    # The head's disk holds only its own windows' files, so it cannot take over the lost worker's layers.
    partial = tmp_path / "head-store"
    partial.mkdir()
    for f in tiny_store.iterdir():
        if not f.name.startswith("layer_") or int(f.stem.split("_")[1]) >= 4:
            os.link(f, partial / f.name)
    with local_ring(None, 2, tmp_path, [4, 4], models=[partial, tiny_store]) as local:  # node1 [0, 4), head [4, 8)
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


def test_restarted_node_rejoins_in_its_old_place(smol_store, expected, tmp_path):
    with local_ring(smol_store, 3, tmp_path, [10, 10, 10]) as local:
        asyncio.run(stream_and_signal(local.addresses[0], PROMPT, TOKENS, local.processes[1].pid, signal.SIGKILL,
                                      after=4))
        assert len(ring.walk(local.addresses[0])) == 2
        local.processes[1].wait()
        local.start_node(1)  # same port, same successor
        deadline = time.monotonic() + 20
        while not (len(nodes := ring.walk(local.addresses[0])) == 3 and all(i.loaded for _, i in nodes)):
            assert time.monotonic() < deadline, "the restarted node did not rejoin"
            time.sleep(0.5)
        assert [a for a, _ in nodes] == local.addresses
        assert collect(local.addresses[0], PROMPT, TOKENS)[0] == expected


def test_sigterm_on_the_head_ends_the_stream_with_a_status(smol_store, tmp_path):
    with local_ring(smol_store, 2, tmp_path, [15, 15]) as local:
        async def run():
            async with PrimaClient(local.addresses[0]) as client:
                async for event in client.generate(PROMPT, max_tokens=TOKENS):  # no EOS within 64 tokens
                    if isinstance(event, Token) and event.index == 3:
                        local.processes[0].terminate()

        with pytest.raises(PrimaError) as err:
            asyncio.run(run())
        assert err.value.code.name in ("UNAVAILABLE", "CANCELLED")
        assert local.processes[0].wait(timeout=10) == 0


def test_corrupted_layer_file_is_named_and_the_node_stays_up(tiny_store, tmp_path):
    broken = tmp_path / "broken-store"
    broken.mkdir()
    for f in tiny_store.iterdir():
        os.link(f, broken / f.name)
    victim = broken / "layer_001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.unlink()  # replace the hard link with a corrupted copy
    victim.write_bytes(bytes(data))
    with local_ring(None, 2, tmp_path, models=[tiny_store, broken]) as local:
        with pytest.raises(ring.RingError, match="layer_001.safetensors: sha256 does not match"):
            ring.start(local.addresses[0], [4, 4])  # node1 would hold [0, 4)
        assert local.processes[1].poll() is None
        info = ring.walk(local.addresses[1])[0][1]
        assert "layer_001.safetensors" in info.error and not info.loaded
