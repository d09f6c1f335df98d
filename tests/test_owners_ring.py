"""A device's owner takes its CPU mid-stream on a real 3-node SmolLM2 ring: the head re-plans once (layers move off
the slow node), 4 concurrent clients lose no request and get the single-process greedy tokens, and when the load
goes away the plan moves back. The load is real: the node's process in a cgroup v1 cpu group at 15 % of a core
(where /sys/fs/cgroup/cpu is writable), or stopped for 85 % of every 200 ms (SIGSTOP / SIGCONT of the process this
test started). A device whose owner needs memory back (its available memory mocked low: tests/owner_needs_memory.py)
gives some back and the head re-plans at once, no request lost."""

import asyncio
import sys
import threading
import time

import pytest

from nodes.ring.replan import MIN_GAIN
from prima_rpc.app import ring
from prima_rpc.app.applied_plan import predict
from prima_rpc.app.live_plan import plan_live
from prima_rpc.app.local_ring import wait_serving
from tests.rings import greedy_reference, local_ring, stream
from tools.bench.owner_load import CpuGroup, Slowed

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Water boils at", "A list of prime numbers: 2, 3,", "Once upon a time"]
TOKENS = 40


def head_info(head: str):
    return ring.walk(head)[0][1]


def drifts(head: str) -> list:
    """The head's re-plans for drift. This machine's own memory pressure (shared with other work) may add re-plans
    for memory (the nodes give memory back for real): those are not this test's event."""
    return [r for r in head_info(head).replans if r.reason != "memory"]


def wait_for(what, timeout: float, every: float = 1.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (got := what()) is not None and got is not False:
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


class Clients:
    """4 clients, each asking its prompt again and again until stopped; every answer and failure kept."""

    def __init__(self, head: str):
        self.head, self.stop = head, threading.Event()
        self.answers: list[tuple[str, list[int]]] = []
        self.failures: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._all()), daemon=True)

    async def _one(self, prompt: str) -> None:
        while not self.stop.is_set():
            try:
                tokens, done = await stream(self.head, prompt, TOKENS)
                self.answers.append((prompt, tokens))
            except Exception as exc:  # a lost request: counted, the client goes on
                self.failures.append(f"{prompt}: {exc}")

    async def _all(self) -> None:
        await asyncio.gather(*(self._one(p) for p in PROMPTS))

    def __enter__(self) -> "Clients":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(300)


# The duty cycle's slowdown reaches the head's samples in bursts: on a loaded 2-core machine one 2 s sample saw the
# node 2.9x slower and the next 1.0x, so the drift never held its 6 s and no re-plan came (three runs after the
# merges). The cgroup quota slows the node evenly; the duty cycle stays as a check that passes where it can.
@pytest.mark.parametrize("how", ["cgroup", pytest.param("duty", marks=pytest.mark.xfail(
    reason="a SIGSTOP duty cycle's slowdown comes in bursts the head's 6 s hold does not see on a loaded machine",
    strict=False))])
def test_a_busy_device_is_replanned_once_and_back_with_no_request_lost(how, smol_store, tmp_path):
    if how == "cgroup" and (why := CpuGroup.usable()):
        pytest.skip(why)
    expected = greedy_reference(smol_store, PROMPTS, TOKENS)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        head, slow = local.addresses[0], local.addresses[1]
        wait_for(lambda: head_info(head).replan_state == "watching", 240)  # the nodes' profiles are in
        # the plan for the devices as profiled (without their owners' load), every device computing
        unloaded = plan_live(head, None, "halda-noselect")["predicted_tpot_ms"]
        with Clients(head) as clients:
            time.sleep(16)  # calibrated: the plan's per-node times set beside what each node measures
            assert list(head_info(head).replans) == []  # nothing drifted yet
            with Slowed(local.processes[1].pid, 0.15, how):
                first = wait_for(lambda: drifts(head) or None, 90)
                windows = {a: [(r.start, r.stop) for r in i.windows] for a, i in ring.walk(head)}
                time.sleep(8)  # still slow: no second re-plan for the same event
                assert len(drifts(head)) == 1
            time.sleep(60)  # the load went away: past the interval and the hold, the head judged the move back
            back = drifts(head)
        assert first[0].node == slow and first[0].reason == "slower", first
        assert first[0].measured_ms > 2.5 * first[0].assumed_ms and first[0].predicted_gain > 0
        assert sum(b - a for a, b in windows[slow]) < 10  # layers moved off the slow node
        assert len(back) <= 2  # one re-plan per event
        if len(back) == 2:
            assert back[1].node == slow and back[1].reason == "faster", back
        # back: the ring's windows are, within what a re-plan must gain, the best plan for the unloaded devices (a
        # re-plan for the node being faster; none when Halda on one machine keeps the shape it moved to)
        assert predict(head, None)["predicted_tpot_ms"] <= unloaded * (1 + MIN_GAIN) + 1e-6
    assert clients.failures == []
    assert len(clients.answers) >= 8
    for prompt, tokens in clients.answers:
        assert tokens == expected[prompt], prompt


def test_a_node_gives_memory_back_and_the_head_replans_with_no_request_lost(smol_store, tmp_path):
    trigger = tmp_path / "owner-needs-memory"
    expected = greedy_reference(smol_store, PROMPTS, TOKENS)
    with local_ring(smol_store, 3, tmp_path / "logs") as local:
        head, member = local.addresses[0], local.addresses[1]
        local.processes[1].terminate()
        local.processes[1].wait(30)
        local.commands[1] = [sys.executable, "-m", "tests.owner_needs_memory", str(trigger), *local.commands[1][3:]]
        local.start_node(1)
        wait_serving(member, local.processes[1], 120, None, local.log("node1"))
        ring.start(head, [10, 10, 10])
        wait_for(lambda: head_info(head).replan_state == "watching", 240)
        before = dict(ring.walk(head))[member]
        with Clients(head) as clients:
            time.sleep(6)
            trigger.touch()
            record = wait_for(lambda: [r for r in head_info(head).replans if r.node == member] or None, 60)[0]
            trigger.unlink()
            time.sleep(4)
        after = dict(ring.walk(head))[member]
    assert record.reason == "memory" and record.node == member
    assert after.max_memory and after.max_memory < max(before.stats.resident_bytes, before.mem_budget)
    assert after.stats.resident_bytes < before.stats.resident_bytes  # it streams layers it kept resident
    assert not after.memory_low  # answered by the re-plan
    assert clients.failures == []
    for prompt, tokens in clients.answers:
        assert tokens == expected[prompt], prompt
