"""A ring outlives its head (real prima-node processes on loopback, SIGKILL for real): the head's successor keeps a
standby copy of the head's units (fetched over the ring when its disk lacks them); when the head is lost the first
member with a complete copy takes over, and a client that knows several members resumes its stream there with the
tokens it already had, so the answer equals the undisturbed reference."""

import asyncio
import json
import time

import pytest

from prima_rpc.app import ring
from prima_rpc.client import PrimaClient, Token
from tests.ctl import ctl
from tests.rings import greedy_tokens, local_ring

pytestmark = pytest.mark.slow
PROMPT = "What is the capital of France?"


def status(node: str) -> list[dict]:
    res = ctl("--node", node, "status", "--json", timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)["nodes"]


def wait_for(get, ok, timeout: float, what: str):
    """get() again and again until ok(its value), for at most `timeout` s; the value."""
    deadline = time.monotonic() + timeout
    while not ok(found := get()):
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f} s: {found}"
        time.sleep(0.3)
    return found


async def stream_and_kill(addresses: list[str], prompt: str, max_tokens: int, proc, after: int, **kwargs):
    """Token ids of one request from a client that knows every member, the head SIGKILLed after `after` tokens;
    and when the kill was."""
    tokens, killed = [], None
    async with PrimaClient(addresses) as client:
        async for event in client.generate(prompt, max_tokens=max_tokens, **kwargs):
            if isinstance(event, Token):
                tokens.append(event.token_id)
                if len(tokens) == after:
                    proc.kill()
                    killed = time.monotonic()
    return tokens, killed


def test_the_head_killed_mid_generation_fails_over_and_the_stream_completes(smol_store, tmp_path, caplog):
    expected = greedy_tokens(smol_store, PROMPT, 64)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        head, standby, worker = local.addresses
        rows = status(head)
        assert [(r["standby"], r["head_copy"]) for r in rows[1:]] == [(True, True), (False, True)]  # one store dir
        # killed at its 2nd token: a head decoding 64 tokens at ~30 ms cannot have sent them all (a stream the client
        # reads behind the head would otherwise complete from gRPC's buffers, with nothing to resume)
        tokens, killed = asyncio.run(stream_and_kill(local.addresses, PROMPT, 64, local.processes[0], after=2))
        assert time.monotonic() - killed < 15, "the stream took over 15 s to complete after the head was killed"
        assert tokens == expected
        assert any("resumed on the head" in r.getMessage() for r in caplog.records)  # the client's one line
        for asked in (standby, worker):
            nodes = status(asked)
            assert [(n["address"], n["state"]) for n in nodes] == [(standby, "up"), (worker, "up"), (head, "lost")]
            assert nodes[0]["role"] == "head"

        local.start_node(0)  # its old command: it comes back as a member, between the worker and the new head
        nodes = wait_for(lambda: status(standby), lambda n: [x["state"] for x in n] == ["up"] * 3
                         and all(x["loaded"] for x in n), 20, "the old head back in the ring")
        assert [(n["address"], n["role"]) for n in nodes] == [(standby, "head"), (worker, "worker"), (head, "worker")]
        res = ctl("--node", f"{head},{standby}", "generate", PROMPT, "--max-tokens", "12", "--temperature", "0",
                  "--json", timeout=60)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout.strip().splitlines()[-1])["tokens"] == expected[:12]


def test_the_head_killed_while_idle_the_next_generate_to_the_members_answers(smol_store, tmp_path):
    expected = greedy_tokens(smol_store, PROMPT, 12)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        local.processes[0].kill()
        local.processes[0].wait()
        killed = time.monotonic()
        res = ctl("--node", ",".join(local.addresses), "generate", PROMPT, "--max-tokens", "12", "--temperature",
                  "0", "--json", timeout=60)
        assert res.returncode == 0, res.stderr
        assert time.monotonic() - killed < 10, "no answer within 10 s of the head's loss"
        assert json.loads(res.stdout.strip().splitlines()[-1])["tokens"] == expected


def test_a_standby_without_the_model_fetches_the_heads_units_and_takes_over(tiny_store, tmp_path):
    caches = [tmp_path / "cache1", tmp_path / "cache2"]
    expected = greedy_tokens(tiny_store, "hello", 8, raw=True)
    with local_ring(None, 3, tmp_path, models=[tiny_store, None, None],
                    extra_args=[[], ["--cache", str(caches[0])], ["--cache", str(caches[1])]]) as local:
        head, standby, worker = local.addresses
        ring.start(head, [4, 2, 2])  # each member fetches its own windows; the standby the head's units too
        rows = wait_for(lambda: status(head), lambda r: r[1]["head_copy"], 30, "a complete standby copy")
        assert [(r["standby"], r["head_copy"]) for r in rows] == [(False, True), (True, True), (False, False)]
        assert sorted(p.name for p in (caches[1]).rglob("*.safetensors")) != \
            sorted(p.name for p in (caches[0]).rglob("*.safetensors"))  # the standby holds more than its windows
        local.processes[0].kill()
        local.processes[0].wait()
        tokens, _ = asyncio.run(stream_from([worker, standby], "hello", 8))
        assert tokens == expected
        nodes = status(worker)
        assert [(n["address"], n["state"], n["role"]) for n in nodes][:2] == [(standby, "up", "head"),
                                                                              (worker, "up", "worker")]


async def stream_from(addresses: list[str], prompt: str, max_tokens: int) -> tuple[list[int], None]:
    tokens = []
    async with PrimaClient(addresses) as client:
        async for event in client.generate(prompt, max_tokens=max_tokens, raw=True):
            if isinstance(event, Token):
                tokens.append(event.token_id)
    return tokens, None
