"""A ring heals by itself (real prima-node processes on loopback, driven through prima-ctl): a worker lost
while the ring is idle is routed around; restarted with its old command it rejoins; a node whose compute
raises ends that request at once with its message and the ring serves the next one."""

import json
import signal
import time

import grpc
import pytest

from prima_rpc.app import ring
from prima_rpc.app.local_ring import wait_serving
from prima_rpc.client import PrimaError
from tests.ctl import ctl
from tests.rings import collect, greedy_tokens, local_ring

pytestmark = pytest.mark.slow
PROMPT = "What is the capital of France?"
TOKENS = 12


def generate(node: str) -> list[int]:
    res = ctl("--node", node, "generate", PROMPT, "--max-tokens", str(TOKENS), "--temperature", "0", "--json",
              timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])["tokens"]


def status(node: str) -> list[dict]:
    res = ctl("--node", node, "status", "--json", timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)["nodes"]


def healed(nodes: list[dict]) -> bool:
    return [n["state"] for n in nodes] == ["up"] * 3 and all(n["loaded"] for n in nodes)


def test_a_worker_lost_while_idle_is_routed_around_and_rejoins_when_restarted(smol_store, tmp_path):
    expected = greedy_tokens(smol_store, PROMPT, TOKENS)
    with local_ring(smol_store, 3, tmp_path) as local:
        head, lost, worker = local.addresses
        ring.start(head, [10, 10, 10], batching=(4, 1))  # a --concurrency plan's batching: it survives re-plans
        assert [n["state"] for n in status(head)] == ["up"] * 3
        local.processes[1].kill()
        local.processes[1].wait()
        killed = time.monotonic()
        assert generate(head) == expected  # on the survivors, replayed if it raced the re-plan
        assert time.monotonic() - killed < 10, "the ring took over 10 s to answer without the lost worker"
        for asked in (head, worker):  # from whichever node it is asked
            nodes = status(asked)
            assert [(n["address"], n["state"]) for n in nodes] == [(head, "up"), (lost, "lost"), (worker, "up")]
            assert nodes[1]["role"] == "unknown" and nodes[2]["windows"] == [[0, 15]]
            assert nodes[0]["max_batch"] == nodes[2]["max_batch"] == 4
        table = ctl("--node", head, "status", timeout=60)
        assert table.returncode == 0 and "LOST" in table.stdout

        local.start_node(1)  # its old command: same port, same successor
        restarted = time.monotonic()
        while not healed(nodes := status(head)):
            assert time.monotonic() - restarted < 15, f"not back in the ring within 15 s: {nodes}"
            time.sleep(0.3)
        assert [n["address"] for n in nodes] == local.addresses
        assert [n["role"] for n in nodes] == ["head", "worker", "worker"]
        assert [n["max_batch"] for n in nodes] == [4, 4, 4]
        assert generate(head) == expected


def test_a_failed_compute_ends_its_request_at_once_and_the_ring_serves_the_next(tiny_store, tmp_path):
    with local_ring(tiny_store, 3, tmp_path) as local:
        # A mock of a fault nothing real causes on demand, an exception inside a node's compute: node2 (it will
        # hold layer 4) restarts, same command, under tests/faulty_node.py, whose first compute of layer 4 raises.
        local.processes[2].terminate()
        local.processes[2].wait()
        python, _, _, *args = local.commands[2]  # python -m nodes.ring.main ARGS
        local.commands[2] = [python, "-m", "tests.faulty_node", "4", *args]
        wait_serving(local.addresses[2], local.start_node(2), 60, log=local.log("node2"))
        ring.start(local.addresses[0], [2, 3, 3])  # node1 [0, 3), node2 [3, 6), the head [6, 8)
        start = time.monotonic()
        with pytest.raises(PrimaError) as err:
            collect(local.addresses[0], "hello", 6, raw=True)
        assert time.monotonic() - start < 2
        assert err.value.code == grpc.StatusCode.INTERNAL
        assert "node2" in err.value.message and "fault injected at layer 4" in err.value.message
        expected = greedy_tokens(tiny_store, "hello", 6, raw=True)
        assert collect(local.addresses[0], "hello", 6, raw=True)[0] == expected
        assert all(i.stats.active_requests == 0 for _, i in ring.walk(local.addresses[0]))
        assert all(p.poll() is None for p in local.processes)


def test_status_names_a_node_that_cannot_be_reached(tiny_store, tmp_path):
    with local_ring(tiny_store, 2, tmp_path) as local:  # unassigned: no head to ask, status walks the successors
        local.processes[1].send_signal(signal.SIGKILL)
        local.processes[1].wait()
        nodes = status(local.addresses[0])
        assert [(n["address"], n["state"]) for n in nodes] == [(local.addresses[0], "up"), (local.addresses[1], "lost")]
        res = ctl("--node", local.addresses[1], "status", timeout=60)
        assert res.returncode != 0 and "cannot reach node" in res.stderr and "Traceback" not in res.stderr
