"""`prima-node --join` on a running ring (real prima-node processes on loopback): the new node is inserted before the
head while requests are in flight (none fails, each equals its reference) and takes layers at the next plan; a wrong
token or another model is one line and changes nothing."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prima_rpc.app import ring
from prima_rpc.app.local_ring import free_ports, last_line, wait_serving
from tests.ctl import ctl
from tests.rings import collect, collect_all, greedy_reference, local_ring

pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France?", "Name a colour.", "Count to five.", "What is 2 + 2?"]


def status(node: str, token: str | None = None) -> list[dict]:
    env = {"PRIMA_TOKEN": token} if token else None
    res = ctl("--node", node, "status", "--json", timeout=60, env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)["nodes"]


def joiner(member: str, log: Path, *args: str, token: str | None = None) -> tuple[subprocess.Popen, str]:
    """A prima-node that joins the ring of `member`, and its address."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    env = {**__import__("os").environ, **({"PRIMA_TOKEN": token} if token else {})}
    cmd = [sys.executable, "-m", "nodes.ring.main", "--host", "127.0.0.1", "--port", address.rpartition(":")[2],
           "--join", member, "--name", "joiner", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return proc, address


def test_a_fourth_node_joins_during_four_requests_and_takes_layers(smol_store, tmp_path):
    expected = greedy_reference(smol_store, PROMPTS, 64)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        head, first, last = local.addresses
        answers = []
        requests = threading.Thread(target=lambda: answers.extend(collect_all(head, PROMPTS, 64)))
        requests.start()
        time.sleep(1.5)  # the requests are under way
        proc, new = joiner(first, tmp_path / "joiner.log", "--cache", str(tmp_path / "cache"))
        try:
            wait_serving(new, proc, 60, log=tmp_path / "joiner.log")
            while new not in [n["address"] for n in status(last)] and proc.poll() is None:
                time.sleep(0.2)
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
            assert collect(head, PROMPTS[0], 64)[0] == expected[PROMPTS[0]]
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
