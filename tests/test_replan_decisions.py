"""The live re-plan's decisions (nodes/ring/replan.py) as tables: drift, hold, hysteresis, the minimum interval,
memory requests, profile scaling and the gain against the cost of moving windows."""

import json
import math
from pathlib import Path

import pytest

from nodes.ring import replan
from nodes.ring.replan import Act, Sample, Settings, Watch
from prima_rpc.spec.profiles import devices_from_json

S = Settings(band=1.5, hold_s=6.0, min_interval_s=30.0)
TESTBED = Path(__file__).resolve().parent.parent / "solver" / "testbeds" / "prima_d1_d4.json"


def ring(b_ms: float, a_ms: float = 10.0, low: bool = False, scaled: bool = True) -> list[Sample]:
    """Three nodes, each assumed at a_ms; b measures b_ms (scaled: the plan assumes b slower than profiled)."""
    return [Sample("a", 10.0, a_ms), Sample("b", b_ms, a_ms, memory_low=low, scaled=scaled), Sample("c", 11.0, a_ms)]


def run(rounds: list[tuple[float, list[Sample]]], watch: Watch = Watch()) -> list[Act | None]:
    acts = []
    for now, samples in rounds:
        watch, act = replan.step(watch, samples, now, S)
        acts.append(act)
    return acts


@pytest.mark.parametrize("rounds, expected", [
    # a node four times slower, held: one act at hold_s, none after it (the interval), its factor is the drift
    ([(0, ring(40)), (3, ring(40)), (6, ring(40)), (9, ring(40))], [None, None, "b slower 4", None]),
    # inside the dead band: never
    ([(t, ring(14)) for t in range(0, 60, 3)], [None] * 20),
    # a blip that goes away before hold_s: nothing; the hold starts over after it
    ([(0, ring(40)), (3, ring(10)), (6, ring(40)), (9, ring(40)), (12, ring(40))],
     [None, None, None, None, "b slower 4"]),
    # faster than assumed (the owner's load went away after a re-plan): the plan moves back
    ([(0, ring(2.5)), (6, ring(2.5))], [None, "b faster 0.25"]),
    # but a node never assumed slower than its profile is not moved for measuring faster (noise, or a warm cache)
    ([(0, ring(2.5, scaled=False)), (6, ring(2.5, scaled=False))], [None, None]),
    # slower then faster without a pause: a change of direction restarts the hold
    ([(0, ring(40)), (5, ring(2.5)), (10, ring(2.5)), (11, ring(2.5))], [None, None, None, "b faster 0.25"]),
    # a round without enough decode frames (unknown time) neither ends a hold nor starts one
    ([(0, ring(40)), (3, [Sample("b", None, 10.0)]), (6, ring(40))], [None, None, "b slower 4"]),
    ([(0, [Sample("b", None, 10.0)]), (6, ring(40))], [None, None]),
    # held long enough, but this round without a time: it acts on the next round that measures the drift
    ([(0, ring(40)), (6, [Sample("b", None, 10.0)]), (8, ring(40))], [None, None, "b slower 4"]),
    # memory back: at once
    ([(0, ring(10, low=True))], ["b memory 1"]),
])
def test_drift_holds_then_acts_once(rounds, expected):
    got = [f"{a.address} {a.reason} {a.factor:g}" if a else None for a in run(rounds)]
    assert got == expected


def test_no_act_within_the_minimum_interval_then_one():
    watch = replan.acted(Watch(), 100.0)  # an act at t = 100
    acts = run([(t, ring(40)) for t in range(100, 150, 3)], watch)
    at = [100 + 3 * i for i, a in enumerate(acts) if a]
    assert at == [130]  # held since 100 (past hold_s), but not before the interval's end


def test_memory_acts_even_within_the_interval():
    assert run([(1, ring(10, low=True))], replan.acted(Watch(), 0.0))[0].reason == "memory"


def test_the_largest_drift_goes_first():
    samples = [Sample("a", 20.0, 10.0), Sample("b", 60.0, 10.0), Sample("c", 1.0, 10.0, scaled=True)]
    acts = run([(0, samples), (6, samples)])
    assert acts[1].address == "c" and acts[1].reason == "faster"  # /10 beats x6


def test_scaled_profile_is_slower_by_the_factor_and_keeps_disk_and_memory():
    d = devices_from_json(json.loads(TESTBED.read_text()))[1]
    s = replan.scaled(d, 4.0)
    assert s.cpu_flops == pytest.approx(d.cpu_flops / 4) and s.ram_bandwidth == pytest.approx(d.ram_bandwidth / 4)
    assert s.token_s == pytest.approx(d.token_s * 4) and s.stream_layer_s == pytest.approx(d.stream_layer_s * 4)
    assert (s.disk_seq_read, s.ram_available, s.link_bandwidth) == (d.disk_seq_read, d.ram_available,
                                                                   d.link_bandwidth)
    back = replan.scaled(s, 0.25)  # the load went away: the profile as measured
    assert (back.cpu_flops, back.token_s) == (pytest.approx(d.cpu_flops), pytest.approx(d.token_s))
    assert replan.with_memory(d, 1 << 30).ram_available == min(d.ram_available, 1 << 30)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            replan.scaled(d, bad)


@pytest.mark.parametrize("old, new, cost, expected", [
    (100.0, 50.0, 2.0, True),  # half the time: 30 s saved over a minute for 2 s of moving
    (100.0, 95.0, 1.0, False),  # 5 %: inside the prediction's error
    (100.0, 80.0, 13.0, False),  # 20 % saves 12 s of 60; moving costs 13
    (100.0, 120.0, 0.0, False),  # slower
    (0.0, 10.0, 0.0, False),  # no old prediction: no gain known
])
def test_worth_it(old, new, cost, expected):
    assert replan.worth_it(old, new, cost) is expected


def test_gain_and_move_cost():
    assert replan.gain(100.0, 60.0) == pytest.approx(0.4)
    # nodes re-read in parallel: the slowest read, then the replay
    assert replan.move_cost_s([100, 0, 300], [100.0, 1.0, 100.0]) == pytest.approx(3.0 + 1.0)
    assert replan.move_cost_s([0, 0], [1.0, 1.0]) == pytest.approx(1.0)


def test_calibration_is_a_median_of_the_first_samples():
    assert replan.calibration([30.0, 10.0], 10.0) is None  # not enough yet
    assert replan.calibration([95.0, 12.0, 11.0], 10.0) == pytest.approx(1.2)  # one busy second does not count
    assert replan.calibration([12.0, 12.0, 12.0], 0.0) is None


@pytest.mark.parametrize("scale, reason, factor, expected", [
    (1.0, "slower", 4.0, 4.0),
    (4.0, "faster", 0.25, 1.0),
    (4.0, "faster", 0.1, 1.0),  # never faster than profiled
    (32.0, "slower", 4.0, 64.0),  # nor past 64 times slower
    (3.0, "memory", 1.0, 3.0),
])
def test_new_scale(scale, reason, factor, expected):
    assert replan.new_scale(scale, Act("b", reason, factor, 0.0, 0.0)) == pytest.approx(expected)
