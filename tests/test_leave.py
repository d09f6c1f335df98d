"""`prima-ctl leave NODE` on a running ring (real prima-node processes on loopback): the head re-plans without the
member while requests are in flight (they replay on the new ring and equal their references), then the member stops;
leaving the head or the last node is one line and changes nothing."""

import json
import threading
import time

import pytest

from tests.ctl import ctl
from tests.rings import collect_all, greedy_reference, local_ring

pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France?", "Name a colour.", "Count to five.", "What is 2 + 2?"]


def status(node: str) -> list[dict]:
    res = ctl("--node", node, "status", "--json", timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)["nodes"]


def test_a_worker_leaves_during_four_requests_and_none_fails(smol_store, tmp_path):
    expected = greedy_reference(smol_store, PROMPTS, 32)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        head, leaving, worker = local.addresses
        answers = []
        requests = threading.Thread(target=lambda: answers.extend(collect_all(head, PROMPTS, 32)))
        requests.start()
        time.sleep(1.5)  # the requests are under way
        res = ctl("--node", worker, "leave", leaving, timeout=120)
        requests.join(120)
        assert res.returncode == 0, res.stderr
        assert f"{leaving} left the ring" in res.stdout
        assert [tokens for tokens, _ in answers] == [expected[p] for p in PROMPTS]
        assert local.processes[1].wait(timeout=15) == 0  # it stopped, gracefully
        nodes = status(head)
        assert [(n["address"], n["state"], n["role"]) for n in nodes] == [(head, "up", "head"),
                                                                          (worker, "up", "worker")]
        time.sleep(2.5)  # it is not taken for lost: the head forgot it
        assert [n["state"] for n in status(head)] == ["up", "up"]


def test_leaving_a_stranger_or_the_last_node_is_one_line_and_changes_nothing(tiny_store, tmp_path):
    """(Leaving the head hands its role to the standby: tests/test_join_handover.py.)"""
    with local_ring(tiny_store, 2, tmp_path, windows=[4, 4]) as local:
        head, worker = local.addresses
        before = status(head)
        res = ctl("--node", worker, "leave", "127.0.0.1:1", timeout=60)
        assert res.returncode != 0 and "is not a member" in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
        assert [(n["address"], n["role"], n["windows"]) for n in status(head)] == \
            [(n["address"], n["role"], n["windows"]) for n in before]
        assert ctl("--node", head, "leave", worker, timeout=60).returncode == 0  # the head alone holds the model
        res = ctl("--node", head, "leave", head, timeout=60)
        assert res.returncode != 0 and "last node" in res.stderr and len(res.stderr.strip().splitlines()) == 1
        assert [(n["address"], n["windows"]) for n in status(head)] == [(head, [[0, 8]])]
