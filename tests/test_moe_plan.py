"""Planning a mixture of experts: a token costs the dense part, top-k experts' compute and the expected misses of the
expert cache its node's memory leaves (uniform routing assumed, as the plan says); Halda finds the exhaustive
optimum; `plan` shows each node's expert bytes per token; a profile's manifest lists its experts."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from prima_rpc.spec.profiles import load_profiles
from solver.cost_model import Instance, device_costs
from solver.device_costs import DeviceCosts, layer_time
from solver.device_terms import allowed, device_terms
from solver.exhaustive import exhaustive
from solver.halda import halda
from solver.model_profile import ModelProfile
from solver.presets import preset
from solver.strategies import EXPERT_HIT_RATE, plan_for
from tests.ctl import ctl_here

TESTBED = Path(__file__).resolve().parents[1] / "solver" / "testbeds" / "prima_d1_d4.json"
# a layer of 100 bytes with its KV (20 dense, 8 experts of 10, top-2: a token routes to a quarter), 1000 bytes of
# RAM (10 such layers), a disk of 1000 B/s; a layer computes in 1 ms, its dense part in 0.2 ms
MOE = DeviceCosts(name="d", is_head=False, routable=True, uma=False, macos=False, forced_fit=False, alpha=1e-3,
                  gpu=float("inf"), hop=0.0, disk=1e3, b=100, b_prime=100, ram=1000, ram_layers=10, gpu_cap=0,
                  experts=0.25, dense_b_prime=20, step_bytes=20, dense_alpha=2e-4)


@pytest.mark.parametrize(("costs", "k", "w", "label", "reads_s", "turn_s"), [
    (MOE, 1, 10, "M4", 0.0, 0.010),  # fits: no reads
    # 20 layers: 1000 bytes over memory, a quarter of them the expected misses (250 B, 0.25 s), read after
    # each layer's dense part (20 x 0.2 ms)
    (MOE, 1, 20, "E", 0.25, 0.25 + 20 * 2e-4),
    (MOE, 2, 10, "E", 0.25, 0.25 + 20 * 2e-4),  # the same share in two rounds
    (replace(MOE, disk=1e6), 1, 20, "E", 250e-6, 0.020),  # a fast disk: compute-bound
    (replace(MOE, disk=1e6, copy=1e-5), 1, 20, "E", 250e-6, 0.020 + 250 * 1e-5),  # ... losing the reads' CPU
])
def test_a_mixtures_share_costs_its_expected_misses(costs, k, w, label, reads_s, turn_s):
    t = device_terms(costs, k, w, 0)
    assert t.label == label and t.overflow is None  # no stream buffer to size
    assert t.reads == pytest.approx(reads_s) and t.inline == pytest.approx(reads_s)
    assert t.turn == pytest.approx(turn_s)


def test_a_share_whose_dense_parts_do_not_fit_is_not_allowed():
    assert allowed(MOE, 1, 49, 0)  # 49 x 20 + one step's 20 experts' bytes = 1000
    assert not allowed(MOE, 1, 50, 0)
    assert allowed(replace(MOE, experts=0.0), 1, 50, 0)  # a dense model streams any share


def test_the_profile_of_a_mixture():
    m = preset("qwen3-30b-a3b")
    cfg = m.config
    assert m.routed_share == 8 / 128 and m.routed_bytes == 8 * m.expert_bytes
    assert m.dense_bytes + 128 * m.expert_bytes == m.layer_bytes_max
    assert m.active_bytes == m.dense_bytes + m.routed_bytes < m.layer_bytes_max / 10  # ~3 B of 30 B
    # the compute reads what a token uses, not every expert
    c = device_costs(Instance(load_profiles(TESTBED), m))[2]
    d = load_profiles(TESTBED)[2]
    assert c.alpha == layer_time(m.layer_flops, m.active_bytes, d.cpu_flops, d.ram_bandwidth)
    assert c.dense_alpha == pytest.approx(c.alpha * m.dense_bytes / m.active_bytes)
    dense = preset("qwen2.5-32b")
    assert (dense.routed_share, dense.routed_bytes, dense.active_bytes) == (0.0, 0, dense.layer_bytes_max)
    assert cfg.n_experts_used == 8


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "tiny-qwen3moe", "qwen2.5-32b"])
def test_a_profiles_manifest_lists_its_experts_and_reads_back(name):
    m = preset(name)
    data = m.to_manifest()
    assert len(data["files"].get("experts", [])) == (m.n_layers if m.moe else 0)
    assert ModelProfile.from_json(data) == m


def cpu_only(devices):
    return tuple(replace(d, gpu_kind="none", vram_free=0, gpu_flops=0) for d in devices)


def test_halda_plans_a_mixture_as_the_exhaustive_search_does():
    """D1-D4 without their GPUs: D3 cannot hold its share of Qwen3-30B-A3B and caches experts."""
    inst = Instance(cpu_only(load_profiles(TESTBED)), preset("qwen3-30b-a3b"))
    plan, best = halda(inst), exhaustive(inst)
    assert plan.predicted_tpot_s == pytest.approx(best.tpot_s, rel=1e-6)
    assert "E" in [d.set_label for d in plan.devices]


def test_the_plan_shows_expert_bytes_per_token_on_each_node(tmp_path):
    m = preset("qwen3-30b-a3b")
    out = plan_for(cpu_only(load_profiles(TESTBED)), m.to_manifest())
    assert out["experts"] == {"hit_rate": EXPERT_HIT_RATE}
    for d in out["devices"]:
        assert d["routed_expert_bytes_per_token"] == out["k"] * d["window"] * m.routed_bytes
        assert 0 <= d["expert_bytes_per_token"] <= d["routed_expert_bytes_per_token"]
        assert (d["expert_bytes_per_token"] > 0) == (d["set"] == "E")
    assert any(d["set"] == "E" for d in out["devices"])
    assert "experts" not in plan_for(load_profiles(TESTBED), preset("qwen2.5-32b").to_manifest())  # dense
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(json.dumps(m.to_manifest()))
    profiles = tmp_path / "cpu.json"
    profiles.write_text(json.dumps({"devices": [d.to_json() for d in cpu_only(load_profiles(TESTBED))]}))
    res = ctl_here("plan", "--profiles", str(profiles), "--model", str(store))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "experts read" in res.stdout and "uniform routing" in res.stdout
    shown = json.loads(ctl_here("plan", "--profiles", str(profiles), "--model", str(store), "--json").stdout)
    assert [d["expert_bytes_per_token"] for d in shown["devices"]] == [d["expert_bytes_per_token"]
                                                                        for d in out["devices"]]
