"""`prima-node --join` on a running ring (real prima-node processes on loopback): the new node is inserted before the
head while requests are in flight (none fails, each equals its reference) and takes layers at the next plan; a wrong
token or another model is one line and changes nothing."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prima_rpc.app import ring
from prima_rpc.app.local_ring import free_ports, last_line, wait_serving
from prima_rpc.client import PrimaClient, Token
from tests.ctl import ctl
from tests.rings import collect, greedy_reference, local_ring

pytestmark = pytest.mark.slow
# The joiner must join while a request is still generating: SmolLM2 ends the short answers within 8-19 tokens, and
# the story runs past TOKENS, so one stream stays in flight ~190 steps after all four have started (with "Count to
# five." at 64 tokens the window was ~45 steps, and a joiner on a busy 2-core machine missed it 2 runs in 6).
PROMPTS = ["What is the capital of France?", "Name a colour.", "Write a short story about a robot who learns to paint.",
           "What is 2 + 2?"]
TOKENS = 200


def status(node: str, token: str | None = None) -> list[dict]:
    env = {"PRIMA_TOKEN": token} if token else None
    res = ctl("--node", node, "status", "--json", timeout=60, env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)["nodes"]


# prima-node's own main, its imports done before it waits for a line on stdin: a gated joiner joins within a
# fraction of a second of the go, not after the seconds its imports take
GATED = ("import sys; import nodes.ring.main as m; print('imported', flush=True); sys.stdin.readline(); "
         "sys.argv[0] = 'prima-node'; m.app()")


def joiner(member: str, log: Path, *args: str, token: str | None = None, gated: bool = False,
           env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A prima-node that joins the ring of `member`, and its address; gated: once a line is written to its stdin."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    env = {**os.environ, **({"PRIMA_TOKEN": token} if token else {}), **(env or {})}
    cmd = [sys.executable, *(("-c", GATED) if gated else ("-m", "nodes.ring.main")), "--host", "127.0.0.1",
           "--port", address.rpartition(":")[2], "--join", member, "--name", "joiner", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.PIPE if gated else subprocess.DEVNULL)
    return proc, address


def streams_under_way(head: str, prompts: list[str], max_tokens: int) -> tuple[threading.Thread, list, threading.Event]:
    """Concurrent requests in a thread, their (tokens, finished) in prompt order once done, and an event set once
    every stream has its first token (they are all in flight, past their prefill)."""
    answers, started, firsts = [], threading.Event(), set()

    async def one(client: PrimaClient, i: int, prompt: str):
        tokens, done = [], None
        async for event in client.generate(prompt, max_tokens=max_tokens):
            if isinstance(event, Token):
                tokens.append(event.token_id)
                firsts.add(i)
                if len(firsts) == len(prompts):
                    started.set()
            else:
                done = event
        return tokens, done

    async def run():
        async with PrimaClient(head) as client:
            answers.extend(await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts))))

    thread = threading.Thread(target=lambda: asyncio.run(run()))
    thread.start()
    return thread, answers, started


def test_a_fourth_node_joins_during_four_requests_and_takes_layers(smol_store, tmp_path):
    expected = greedy_reference(smol_store, PROMPTS, TOKENS)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        head, first, last = local.addresses
        proc, new = joiner(first, tmp_path / "joiner.log", "--cache", str(tmp_path / "cache"), gated=True)
        try:
            requests, answers, started = streams_under_way(head, PROMPTS, TOKENS)
            assert started.wait(60), "the four streams did not start"
            proc.stdin.write(b"go\n")  # join now, while every stream is generating
            proc.stdin.close()
            wait_serving(new, proc, 60, log=tmp_path / "joiner.log")
            while new not in [a for a, _, _ in ring.status(last)] and proc.poll() is None:
                time.sleep(0.05)
            assert requests.is_alive()  # it joined while the requests were in flight
            requests.join(120)
            assert [tokens for tokens, _ in answers] == [expected[p] for p in PROMPTS]
            nodes = status(last)
            assert [(n["address"], n["role"]) for n in nodes] == [(head, "head"), (first, "worker"),
                                                                 (last, "worker"), (new, "relay")]
            assert nodes[-1]["state"] == "joined"  # no model of its own: it takes layers when a plan gives some
            ring.start(head, [8, 8, 7, 7])  # the ring found by its walk has the new node before the head
            nodes = status(head)
            assert nodes[-1]["address"] == new and nodes[-1]["windows"] and nodes[-1]["fetched_bytes"] > 0
            assert nodes[-1]["state"] == "up"
            assert collect(head, PROMPTS[0], TOKENS)[0] == expected[PROMPTS[0]]
        finally:
            proc.terminate()
            proc.wait(15)


def test_joining_with_a_wrong_token_or_another_model_is_one_line_and_changes_nothing(tiny_store, tiny_qwen_store,
                                                                                      tmp_path):
    with local_ring(tiny_store, 2, tmp_path, windows=[4, 4], token="right") as local:
        head, worker = local.addresses
        before = [(n["address"], n["role"], n["windows"]) for n in status(head, "right")]
        cases = ((("--cache", str(tmp_path / "c1")), "wrong", "UNAUTHENTICATED"),
                 (("--model", str(tiny_qwen_store)), "right", "this node's store holds model"))
        for i, (args, token, said) in enumerate(cases):
            proc, _ = joiner(worker, tmp_path / f"bad{i}.log", *args, token=token)
            assert proc.wait(60) == 2
            line = last_line(tmp_path / f"bad{i}.log")
            assert line.startswith("error: ") and said in line, line
            assert "Traceback" not in (tmp_path / f"bad{i}.log").read_text()
            assert [(n["address"], n["role"], n["windows"]) for n in status(head, "right")] == before
