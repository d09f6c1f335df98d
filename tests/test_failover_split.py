"""Split brain (real prima-node processes on loopback, SIGSTOP and SIGCONT for real): a head cut off past the failover
timeout is replaced by its standby; once it runs again it sees its members follow a newer ring and steps down, so one
head answers. A request sent to it the moment it is back is resumed on the new head with the reference's tokens, and
the new head wires the old one back in as a member."""

import asyncio
import os
import signal
import threading
import time

import pytest

from prima_rpc.client import PrimaClient, Token
from prima_rpc.control import Control, Deadlines
from tests.rings import collect, greedy_tokens, local_ring
from tests.test_failover import status, wait_for

pytestmark = pytest.mark.slow
PROMPT = "What is the capital of France?"
LONG = "Write a long story about a dragon who learns to fly."


def streaming(address: str, prompt: str, max_tokens: int) -> tuple[threading.Thread, threading.Event]:
    """One request in a thread (its token ids in thread.tokens once done), and an event set at its first token."""
    first = threading.Event()

    async def run():
        async with PrimaClient(address, timeout=120) as client:
            async for event in client.generate(prompt, max_tokens=max_tokens):
                if isinstance(event, Token):
                    thread.tokens.append(event.token_id)
                    first.set()

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.tokens = []
    thread.start()
    return thread, first


def heads(*addresses: str) -> dict[str, str]:
    """address -> the head it names (itself when it claims the role), of each node that answers."""
    out = {}
    for address in addresses:
        try:
            with Control(address, None, Deadlines(info=2.0)) as peer:
                info = peer.info()
        except Exception:  # noqa: BLE001 - a node that does not answer names no head
            continue
        out[address] = address if info.role == "head" else info.head
    return out


async def tokens_from(addresses: list[str], prompt: str, max_tokens: int) -> list[int]:
    # a deadline on each call: a request the ring never ends fails the test instead of hanging the suite; above the
    # head's step timeout (60 s), so a step lost once ends UNAVAILABLE and the test's "< 30 s" check tells the two apart
    async with PrimaClient(addresses, timeout=150) as client:
        return [e.token_id async for e in client.generate(prompt, max_tokens=max_tokens) if isinstance(e, Token)]


def test_a_head_stopped_past_the_failover_timeout_steps_down_once_it_runs_again(smol_store, tmp_path):
    expected = greedy_tokens(smol_store, PROMPT, 24)
    long_expected = greedy_tokens(smol_store, LONG, 96)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        old, standby, worker = local.addresses
        pid = local.processes[0].pid
        os.kill(pid, signal.SIGSTOP)  # cut off: it holds its sockets but answers nothing
        try:
            wait_for(lambda: heads(standby, worker), lambda h: h == {standby: standby, worker: standby}, 60,
                     "the standby heading the survivors")
            assert collect(standby, PROMPT, 24)[0] == expected  # the new head serves meanwhile
            # a request in flight on the new head keeps it from wiring the old one back in (it does that idle), so
            # only the old head's own step-down can end the split
            busy, first = streaming(standby, LONG, 96)
            assert first.wait(60)
        finally:
            os.kill(pid, signal.SIGCONT)
        # at once, a client that knows every member, the old head first (it still believes it is the head)
        started = time.monotonic()
        assert asyncio.run(tokens_from([old, standby, worker], PROMPT, 24)) == expected
        assert time.monotonic() - started < 30
        busy.join(120)
        assert busy.tokens == long_expected  # the new head's stream went on undisturbed
        assert "stepping down" in (tmp_path / "node0.log").read_text()
        named = wait_for(lambda: heads(old, standby, worker), lambda h: len(h) == 3 and set(h.values()) == {standby},
                         20, "every node naming the new head")
        assert named[old] == standby  # the old head gave way: one head in the ring
        nodes = wait_for(lambda: status(standby), lambda n: [x["state"] for x in n] == ["up"] * 3
                         and all(x["loaded"] for x in n), 30, "the old head back as a member")
        assert [(n["address"], n["role"]) for n in nodes] == [(standby, "head"), (worker, "worker"), (old, "worker")]
        assert [(n["address"], n["role"]) for n in status(old)] == [(standby, "head"), (worker, "worker"),
                                                                   (old, "worker")]
        assert asyncio.run(tokens_from([old, worker], PROMPT, 24)) == expected  # sent on to the one head
