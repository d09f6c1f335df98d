"""A graceful end of the head (real prima-node processes on loopback): SIGTERM on the head hands its role to the
standby, and the stream of a client that knows every member resumes there with the reference's tokens; `prima-ctl
leave HEAD` makes the standby the head, and the old head stops and is forgotten."""

import json
import signal
import threading
import time

import pytest

from tests.ctl import ctl
from tests.rings import collect, collect_all, greedy_reference, local_ring

pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France?", "Name a colour.", "Count to five.", "What is 2 + 2?"]


def status(node: str) -> list[dict]:
    res = ctl("--node", node, "status", "--json", timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)["nodes"]


def wait_standby(node: str) -> None:
    deadline = time.monotonic() + 60
    while not any(n.get("head_copy") for n in status(node)[1:]):
        assert time.monotonic() < deadline, "no standby copy"
        time.sleep(0.5)


def test_sigterm_on_the_head_hands_over_and_the_streams_resume(smol_store, tmp_path):
    expected = greedy_reference(smol_store, PROMPTS, 48)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        head, standby, worker = local.addresses
        wait_standby(head)
        answers = []
        requests = threading.Thread(target=lambda: answers.extend(collect_all(local.addresses, PROMPTS, 48)))
        requests.start()
        time.sleep(1.5)  # the requests are under way
        local.processes[0].send_signal(signal.SIGTERM)
        requests.join(120)
        assert [tokens for tokens, _ in answers] == [expected[p] for p in PROMPTS]
        assert local.processes[0].wait(timeout=15) == 0
        nodes = status(worker)
        assert [(n["address"], n["state"]) for n in nodes] == [(standby, "up"), (worker, "up"), (head, "lost")]
        assert nodes[0]["role"] == "head"  # it rejoins as a member when restarted, as after a failover


def test_leaving_the_head_hands_its_role_to_the_standby(smol_store, tmp_path):
    expected = greedy_reference(smol_store, PROMPTS[:1], 32)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        head, standby, worker = local.addresses
        wait_standby(head)
        res = ctl("--node", worker, "leave", head, timeout=120)
        assert res.returncode == 0, res.stderr
        assert local.processes[0].wait(timeout=15) == 0
        nodes = status(worker)
        assert [(n["address"], n["role"], n["state"]) for n in nodes] == [(standby, "head", "up"),
                                                                         (worker, "worker", "up")]
        assert collect(standby, PROMPTS[0], 32)[0] == expected[PROMPTS[0]]
