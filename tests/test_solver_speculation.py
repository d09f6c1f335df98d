"""The speculative TPOT model: tokens per trip, when speculating pays, and `prima-ctl plan --speculate-accept`."""

import json

import pytest

from solver.presets import preset
from solver.speculation import best_draft, best_inflight, inflight_tpot, speculative_tpot, tokens_per_trip
from solver.strategies import plan_offline
from tests.ctl import ctl, ctl_here


@pytest.mark.parametrize("draft, rate, expected", [(0, 0.5, 1.0), (3, 0.0, 1.0), (3, 1.0, 4.0), (2, 0.5, 1.75)])
def test_tokens_per_trip(draft, rate, expected):
    assert tokens_per_trip(draft, rate) == pytest.approx(expected)


def test_a_trip_dominated_by_hops_and_disk_pays_to_speculate():
    # An offloading ring: 1 s a trip, 20 ms compute per extra position, 70 % acceptance.
    n, tpot = best_draft(1.0, 0.02, 0.7)
    assert n >= 4 and tpot < 0.4
    assert speculative_tpot(1.0, 0.02, n, 0.7) == tpot


def test_compute_bound_and_rarely_accepted_does_not():
    assert best_draft(0.05, 0.05, 0.1) == (0, 0.05)
    with pytest.raises(ValueError):
        tokens_per_trip(2, 1.5)


def device(name: str, head: bool) -> dict:
    return {"name": name, "os": "linux", "cpu_flops": 1e11, "gpu_flops": 0, "gpu_kind": "none",
            "ram_bandwidth": 5e9, "vram_bandwidth": 0, "disk_seq_read": 2e9, "disk_rand_read": 1e9,
            "ram_available": 32 * 2**30, "vram_free": 0, "link_latency_s": 0.005, "link_bandwidth": 5e7,
            "is_head": head}


@pytest.fixture
def two_cpus(tmp_path):
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"devices": [device("A", True), device("B", False)]}))
    return path


# Llama 3 8B, by hand: a layer's matrices hold 4096 (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336 = 218,103,808
# weights (2 FLOPs each), 32 layers; the output projection 4096 * 128,256. Both devices run 1e11 FLOP/s, so
# one more position costs (32 * 436,207,616 + 2 * 4096 * 128,256) / 1e11 s whatever the split.
POSITION_MS = (32 * 2 * 218_103_808 + 2 * 4096 * 128_256) / 1e11 * 1e3


@pytest.mark.parametrize("draft, rate", [(2, 0.5), (4, 0.7), (4, 0.0)])
def test_plan_accounts_for_verification_frames(two_cpus, draft, rate):
    manifest = preset("llama3-8b").to_manifest()
    plain = plan_offline(two_cpus, manifest)
    out = plan_offline(two_cpus, manifest, speculation=(draft, rate))
    s = out.pop("speculation")
    assert (out.pop("depth"), out.pop("draft_tokens")) == (s["depth"], s["inflight_draft_tokens"])  # its pick
    assert out == {**plain, "solve_ms": out["solve_ms"]}  # every existing field kept, unchanged
    tpot = plain["predicted_tpot_ms"]
    per_trip = {(2, 0.5): 1.75, (4, 0.7): (1 - 0.7 ** 5) / 0.3, (4, 0.0): 1.0}[draft, rate]
    assert s["position_compute_ms"] == pytest.approx(POSITION_MS)
    assert s["tokens_per_trip"] == pytest.approx(per_trip)
    assert s["trip_ms"] == pytest.approx(tpot + draft * POSITION_MS)
    assert s["tpot_ms_speculative"] == pytest.approx((tpot + draft * POSITION_MS) / per_trip)
    if rate == 0.0:  # nothing accepted: drafting only costs, and the best is not to draft, at today's TPOT
        assert s["best_draft_tokens"] == 0 and s["tpot_ms_best"] == tpot
    else:
        assert s["best_draft_tokens"] > 0 and s["tpot_ms_best"] < tpot


def test_prima_ctl_plan_speculate_accept(two_cpus, tmp_path):
    store = tmp_path / "l8"
    assert ctl("synth", str(store), "--preset", "llama3-8b", "--manifest-only").returncode == 0
    base = ("plan", "--profiles", str(two_cpus), "--model", str(store))
    res = ctl(*base, "--speculate-accept", "0.7", "--draft-tokens", "4", "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    s = plan["speculation"]
    assert (plan["depth"], plan["draft_tokens"]) == (s["depth"], s["inflight_draft_tokens"])
    assert s["tpot_ms_inflight"] <= s["tpot_ms_best"] < plan["predicted_tpot_ms"]
    assert s["draft_tokens"] == 4 and s["accept_rate"] == 0.7 and s["tokens_per_trip"] == pytest.approx(2.7731)
    res = ctl(*base, "--speculate-accept", "0.7")
    assert res.returncode == 0 and "speculating 4 tokens a trip accepted at 0.7" in res.stdout, res.stderr
    for bad, message in [(("--speculate-accept", "1.5"), "--speculate-accept must be in [0, 1]"),
                         (("--speculate-accept", "0.5", "--draft-tokens", "0"), "--draft-tokens must be in [1, 16]"),
                         (("--draft-tokens", "3"), "--draft-tokens needs --speculate-accept")]:
        res = ctl_here(*base, *bad)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_windows_in_flight_by_hand():
    # A 4-device ring: 200 ms a plain trip, 50 ms its slowest device, 2 ms a position more, drafts free, a = 0.7.
    # N = 4: a window takes 208 ms; at D = 8 they come back every max(58, 26) = 58 ms; a chain breaks after
    # 0.7^4 / (1 - 0.7^4) windows on average, and yields 1 / 0.3 tokens.
    expected = (208 + 58 * 0.7 ** 4 / (1 - 0.7 ** 4)) * 0.3
    assert inflight_tpot(0.2, 0.05, 0.002, 0.0, 4, 8, 0.7) * 1e3 == pytest.approx(expected)
    assert inflight_tpot(0.2, 0.05, 0.002, 0.0, 4, 1, 0.7) == speculative_tpot(0.2, 0.002, 4, 0.7)  # D = 1: today's
    assert inflight_tpot(0.2, 0.05, 0.002, 0.0, 4, 8, 1.0) == pytest.approx(0.058 / 4)  # all accepted: the stage
    depth, draft, tpot = best_inflight(0.2, 0.05, 0.002, 0.0, 0.7)
    assert depth > 1 and draft > 0 and tpot < 0.5 * 0.2  # the goal at 0.7, priced
    assert tpot <= expected * 1e-3


def test_plain_decoding_where_speculation_cannot_pay():
    # Nothing accepted, or one device whose drafts cost more than the trip they save.
    assert best_inflight(0.2, 0.05, 0.002, 0.0, 0.0) == (1, 0, 0.2)
    assert best_inflight(0.02, 0.02, 0.01, 0.05, 0.5) == (1, 0, 0.02)


def test_a_plan_that_needs_the_ring_keeps_windows_in_flight(tmp_path):
    """Llama 3 8B on four devices of 2 GiB with slow disks: Halda splits it, and windows in flight beat one."""
    devices = [device(f"D{i}", i == 0) | {"ram_available": 2 * 2**30, "disk_seq_read": 1e8, "disk_rand_read": 5e7,
                                          "cpu_flops": 1e12} for i in range(4)]
    path = tmp_path / "four.json"
    path.write_text(json.dumps({"devices": devices}))
    out = plan_offline(path, preset("llama3-8b").to_manifest(), speculation=(4, 0.7, 0.0))
    s = out["speculation"]
    assert sum(d["window"] > 0 for d in out["devices"]) > 1
    assert out["depth"] > 1 and out["draft_tokens"] > 0
    assert s["tpot_ms_inflight"] < s["tpot_ms_best"] < out["predicted_tpot_ms"]
    expensive = plan_offline(path, preset("llama3-8b").to_manifest(), speculation=(4, 0.7, 10.0))  # 10 s a draft
    assert (expensive["depth"], expensive["draft_tokens"]) == (1, 0)
