"""The home testbed: a 2-device home with unequal CPU shares and 5 ms links, a real ring inside it, and nothing
left behind (tools/testbed). Needs root's cgroups and network namespaces; skipped with the reason elsewhere."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from prima_rpc.app import ring
from prima_rpc.app.live_plan import profile_ring
from tests.rings import collect, greedy_tokens
from tools.testbed import bed, cgroups, netns
from tools.testbed.home import HomeError, home_from_json, load_home

BASE = 17600  # apart from a developer's testbed on the default 17000
PROMPT = "What is the capital of France?"


def _unusable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (cgroups and network namespaces)"
    tree = cgroups.Tree.detect()
    home = load_home("pair")
    problems = [p for p in tree.problems(home.devices, None) if not p.startswith("disk speed")]
    return problems[0] if problems else netns.usable()


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_unusable() is not None, reason=str(_unusable()))]


def run_testbed(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.testbed", *args, "--base-port", str(BASE)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pair(smol_store):
    up = run_testbed("up", "pair", "--model", str(smol_store), "--json")
    try:
        assert up.returncode == 0, up.stderr
        yield json.loads(up.stdout)
    finally:
        down = run_testbed("down")
        assert down.returncode == 0, down.stderr


def test_up_reports_each_device_with_its_limits(pair):
    assert pair["head"] == "127.0.1.1:17600"
    laptop, netbook = pair["devices"]
    assert (laptop["name"], laptop["address"], laptop["cpu"], laptop["memory_bytes"]) == \
        ("laptop", "127.0.1.1:17600", 0.6, 900 << 20)
    assert (netbook["address"], netbook["cpu"], netbook["latency_ms"], netbook["mbps"]) == \
        ("127.0.2.1:17601", 0.3, 5.0, 200.0)
    for d in pair["devices"]:
        groups = cgroups.DeviceGroups(cgroups.Tree.detect(), f"{BASE}/{d['name']}")
        assert d["pid"] in groups.pids()
        assert groups.memory_usage()["limit"] == d["memory_bytes"]


def test_the_profiler_sees_each_device_inside_its_limits(pair):
    profiles, _ = profile_ring(pair["head"], None, refresh=True)
    laptop, netbook = profiles["devices"]
    # RAM: the device's group, not the machine's 24 GiB (the node's runtime already holds some of it)
    for profile, device in ((laptop, pair["devices"][0]), (netbook, pair["devices"][1])):
        assert 0 < profile["ram_available"] < device["memory_bytes"]
        # a hop crosses both devices' 5 ms links each way: 10 ms one way, plus the nodes' own handling
        assert 0.010 <= profile["link_latency_s"] < 0.016, profile["link_latency_s"]
    # twice the CPU share computes faster (the benchmark holds the ratio to 20 %, on a quiet machine)
    assert laptop["cpu_flops"] > 1.3 * netbook["cpu_flops"], (laptop["cpu_flops"], netbook["cpu_flops"])
    assert netbook["link_bandwidth"] < 200e6 / 8 * 1.1  # the netbook's 200 Mbps caps both directions


def test_a_ring_over_the_links_gives_the_reference_tokens(pair, smol_store):
    ring.start(pair["head"], [20, 10])
    tokens, finished = collect(pair["head"], PROMPT, 12, temperature=0.0)
    assert tokens == greedy_tokens(smol_store, PROMPT, 12)
    assert finished is not None


def test_down_leaves_no_process_group_or_namespace(smol_store):
    home = home_from_json({"devices": [
        {"name": "a", "cpu": 0.3, "memory": "600MiB", "disk_mbps": 100, "latency_ms": 1, "mbps": 100},
        {"name": "b", "cpu": 0.3, "memory": "600MiB", "disk_mbps": 100, "latency_ms": 1, "mbps": 100}]})
    base = BASE + 50
    got = bed.up(home, smol_store, base=base, say=lambda line: None)
    pids = [d["pid"] for d in got["devices"]] + [d["shaper_pid"] for d in bed.read_state(base)["devices"]]
    assert all(psutil.pid_exists(p) for p in pids)
    bed.down(base, say=lambda line: None)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert cgroups.leftovers(str(base)) == []
    assert netns.names(f"{bed.NETNS_PREFIX}{base}-") == []
    assert not (bed.RUN_ROOT / str(base)).exists()


def test_bad_homes_get_one_clear_line(tmp_path):
    with pytest.raises(HomeError, match="cpu must be a number"):
        home_from_json({"devices": [{"name": "a", "cpu": "fast", "memory": "1GiB", "disk_mbps": 1,
                                     "latency_ms": 1, "mbps": 1}]})
    with pytest.raises(HomeError, match="names repeat"):
        home_from_json({"devices": [{"name": "a", "cpu": 1, "memory": "1GiB", "disk_mbps": 1, "latency_ms": 1,
                                     "mbps": 1}] * 2})
    done = subprocess.run([sys.executable, "-m", "tools.testbed", "up", "no-such-home", "--model", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: no preset or home file 'no-such-home'")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("strategy", ["exo", "even"])
def test_a_live_plan_of_each_strategy_applies_and_keeps_the_tokens(pair, smol_store, strategy, tmp_path):
    plan_file = tmp_path / "plan.json"
    cli = [sys.executable, "-m", "prima_rpc.app.cli", "--node", pair["head"]]
    made = subprocess.run([*cli, "plan", "--strategy", strategy, "--json", "--out", str(plan_file)],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    plan = json.loads(made.stdout)
    assert plan["strategy"] == strategy and plan["predicted_tpot_ms"] > 0
    started = subprocess.run([*cli, "start", "--plan", str(plan_file)], capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    tokens, _ = collect(pair["head"], PROMPT, 8, temperature=0.0)
    assert tokens == greedy_tokens(smol_store, PROMPT, 8)
