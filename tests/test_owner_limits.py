"""A device owner's limits and the memory watch's decisions (nodes/ring/owner.py); re-plans in status and metrics."""

import os

import pytest

from nodes.ring import owner
from nodes.ring.main import parse_size
from nodes.ring.metrics import owner_families
from prima_rpc.app.status_rows import busy_words, ring_replans, status_row
from prima_rpc.spec.profiles import DeviceProfile
from prima_rpc.v1 import prima_pb2 as pb

PSI = """some avg10=7.25 avg60=1.00 avg300=0.20 total=123
full avg10=0.50 avg60=0.00 avg300=0.00 total=4
"""


def test_psi_is_read_from_the_some_line(tmp_path):
    assert owner.parse_psi(PSI) == pytest.approx(7.25)
    assert owner.parse_psi("garbage") is None
    (tmp_path / "memory").write_text(PSI)
    assert owner.memory_pressure(tmp_path / "memory") == pytest.approx(7.25)
    assert owner.memory_pressure(tmp_path / "absent") is None  # macOS, Windows, old kernels
    assert owner.available_memory() > 0


@pytest.mark.parametrize("text, expected", [
    ("50%", 500), ("100%", 1000), ("2KiB", 2048), ("0", 0), ("12.5%", 125),
])
def test_max_memory_is_a_size_or_a_share_of_available(text, expected):
    assert owner.parse_max_memory(text, 1000, parse_size) == expected


@pytest.mark.parametrize("text", ["0%", "150%", "x%", "-5%"])
def test_bad_max_memory(text):
    with pytest.raises(ValueError, match="--max-memory"):
        owner.parse_max_memory(text, 1000, parse_size)


@pytest.mark.parametrize("fraction, cores, threads", [(1.0, 8, 8), (0.5, 8, 4), (0.25, 2, 1), (0.1, 2, 1)])
def test_cpu_threads(fraction, cores, threads):
    assert owner.cpu_threads(fraction, cores) == threads


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_bad_max_cpu(bad):
    with pytest.raises(ValueError, match="--max-cpu"):
        owner.check_max_cpu(bad)


def test_the_tightest_memory_cap_wins():
    assert owner.budget(0, 0, 0) == 0
    assert owner.budget(2 << 30, 0, 1 << 30) == 1 << 30
    assert owner.budget(0, 3 << 30) == 3 << 30


@pytest.mark.parametrize("pressure, available, total, needs", [
    (7.0, 900, 1000, True),  # stalls past PSI_HIGH
    (1.0, 900, 1000, False),
    (1.0, 40, 1000, True),  # PSI calm but nearly nothing left
    (None, 50, 1000, True),  # no PSI: under RESERVE available
    (None, 200, 1000, False),
])
def test_needs_memory(pressure, available, total, needs):
    assert owner.needs_memory(pressure, available, total) is needs


def test_smaller_budget_gives_back_a_quarter_of_what_is_used():
    assert owner.smaller_budget(1 << 30, 512 << 20) == 384 << 20
    assert owner.smaller_budget(0, 1 << 30) == 768 << 20  # no budget set: of what it holds
    assert owner.smaller_budget(0, 0) == owner.MIN_BUDGET
    assert owner.smaller_budget(80 << 20, 80 << 20) == owner.MIN_BUDGET


def profile() -> DeviceProfile:
    return DeviceProfile("d", "linux", 1e11, 0.0, "none", 2e10, 0.0, 1e9, 1e9, 8 << 30, 0, 1e-3, 1e8, token_s=1e-3)


def test_max_cpu_scales_the_profile_only_below_its_threads():
    cores = os.cpu_count() or 1
    p = profile()
    assert owner.limited(p, 1.0) == p
    whole = 1 / cores  # one whole core: one thread, measured as such
    assert owner.limited(p, whole).cpu_flops == pytest.approx(p.cpu_flops)
    half = 0.5 / cores  # half a core: one thread at half its rate
    assert owner.limited(p, half).cpu_flops == pytest.approx(p.cpu_flops / 2)
    assert owner.limited(p, half).token_s == pytest.approx(p.token_s * 2)


def test_lower_priority_says_what_it_did():
    # in a child, so this test process keeps its priority
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        done = owner.lower_priority()
        os.write(w, f"{','.join(done)}|{os.nice(0)}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    done, nice = os.read(r, 200).decode().split("|")
    assert "nice 19" in done and int(nice) == 19


def head_info() -> pb.NodeInfo:
    return pb.NodeInfo(role="head", name="n0", address="a:1", max_cpu=0.5, available_memory=1 << 30,
                       memory_pressure=2.5, replans=[
                           pb.Replan(at=1000.0, reason="slower", node="b:2", assumed_ms=10.0, measured_ms=41.0,
                                     predicted_gain=0.4, seconds=3.2),
                           pb.Replan(at=1100.0, reason="faster", node="b:2", assumed_ms=40.0, measured_ms=9.0,
                                     predicted_gain=0.3, seconds=2.0)])


def test_status_json_lists_the_replans_and_says_in_words_what_happened():
    info = head_info()
    replans = ring_replans([("a:1", "up", info), ("b:2", "lost", None)])
    assert replans == [
        {"at": 1000.0, "reason": "slower", "node": "b:2", "assumed_ms": 10.0, "measured_ms": 41.0,
         "predicted_gain": 0.4, "seconds": 3.2},
        {"at": 1100.0, "reason": "faster", "node": "b:2", "assumed_ms": 40.0, "measured_ms": 9.0,
         "predicted_gain": 0.3, "seconds": 2.0}]
    row = status_row("a:1", "up", info)
    assert (row["max_cpu"], row["available_memory"], row["memory_pressure"]) == (0.5, 1 << 30, 2.5)
    words = busy_words([row], replans[:1])
    assert "b:2 got busy (41 ms a token, the plan assumed 10)" in words and "the ring adapted" in words
    assert "is free again" in busy_words([row], replans)
    assert busy_words([row], []) == ""


def test_metrics_count_replans_by_reason():
    families = {f.name: f for f in owner_families(head_info())}
    counts = {s.labels["reason"]: s.value for s in families["prima_replans"].samples if s.name.endswith("_total")}
    assert counts == {"slower": 1, "faster": 1, "memory": 0}
    assert families["prima_last_replan_seconds"].samples[0].value == 2.0
    assert families["prima_memory_pressure_percent"].samples[0].value == 2.5
    assert "prima_replans" not in {f.name for f in owner_families(pb.NodeInfo(role="worker"))}
