"""The plan timeline: one token's journey adds up to the cost model's TPOT, and renders as PNG and SVG."""

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from solver.presets import preset
from solver.strategies import plan_offline
from solver.timeline import SIDE, bottleneck, journey, render
from tests.ctl import ctl, ctl_here

TESTBED = Path(__file__).resolve().parents[1] / "solver" / "testbeds" / "prima_d1_d4.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CASES = [(m, s) for m in ("llama3-70b", "llama3-8b") for s in ("halda", "halda-noselect", "exo", "even")]


def solved(model: str = "llama3-70b", strategy: str = "halda", **kwargs) -> dict:
    return json.loads(json.dumps(plan_offline(TESTBED, preset(model).to_manifest(), strategy, **kwargs)))


def overlaps(a: tuple[float, float], b: tuple[float, float], period: float) -> bool:
    """Do intervals [start, end) overlap modulo one period (the steady state repeats every TPOT)?"""
    return any(a[0] + s < b[1] - 1e-6 and b[0] < a[1] + s - 1e-6 for s in (-period, 0.0, period))


@pytest.mark.parametrize("model, strategy", CASES, ids=lambda x: x)
def test_journey_adds_up_to_the_predicted_tpot(model, strategy):
    plan = solved(model, strategy)
    bars, total = journey(plan)
    assert total == pytest.approx(plan["predicted_tpot_ms"], rel=1e-9)
    for i, d in enumerate(plan["devices"]):  # every term of the cost model is drawn, once
        mine = [b for b in bars if b.device == i]
        assert sum(b.ms for b in mine if b.kind == "compute") == pytest.approx(d["compute_ms"])
        assert sum(b.ms for b in mine if b.kind in ("load", "beside", "prefetch")) == pytest.approx(d["disk_ms"])
        assert sum(b.ms for b in mine if b.kind == "link") == pytest.approx(d["link_ms"])
        # A device does one thing at a time: its prefetched loads never overlap its own computes.
        computes = [(b.start_ms, b.start_ms + b.ms) for b in mine if b.kind == "compute"]
        for b in (b for b in mine if b.kind == "prefetch"):
            assert not any(overlaps((b.start_ms, b.start_ms + b.ms), c, total) for c in computes), (d["name"], b)
    # The critical path is one bar after another (prefetched reads and reads beside compute run beside it).
    path = [b for b in bars if b.kind not in SIDE]
    assert all(a.start_ms + a.ms == pytest.approx(b.start_ms) for a, b in zip(path, path[1:]))
    assert path[-1].kind == "output" and path[-1].device == 0


def test_70b_halda_reads_beside_compute_and_names_d3_the_bottleneck():
    """k = 2: D2 and D3 prefetch in the gaps (through whole-layer buffers, 1 and 2 layers) and read the rest
    in their turns, where both outlast their compute; D3, busiest per token (compute beside loads, hops), is
    the bottleneck, and the ring waits on their reads; D3's cycle binds by a hair (0.14 ms of 880: its gaps hide
    what they can, since a byte read in a gap costs its turn no CPU), nothing more."""
    plan = solved()
    bars, total = journey(plan)
    name = {i: d["name"] for i, d in enumerate(plan["devices"])}
    assert name[bottleneck(plan)] == "D3"
    on_path = {name[b.device] for b in bars if b.kind == "load"}
    assert on_path == {"D2", "D3"} and {name[b.device] for b in bars if b.kind == "beside"} == {"D2", "D3"}
    assert {name[b.device] for b in bars if b.kind == "prefetch"} == {"D2", "D3"}
    assert sum(b.ms for b in bars if b.kind == "wait") < 1e-3 * total
    assert [b.label for b in bars if b.kind == "compute" and b.device == 2] == ["[14,37)", "[54,77)"]


def test_8b_on_d3_alone_has_an_empty_head_window_and_removed_devices():
    plan = solved("llama3-8b")
    bars, _ = journey(plan)
    roles = {d["name"]: d["role"] for d in plan["devices"]}
    assert roles["D1"] == "head" and "removed" in roles.values()
    drawn = {plan["devices"][b.device]["name"] for b in bars}
    assert drawn == {name for name, role in roles.items() if role != "removed"}


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_render_writes_the_format_of_the_suffix(tmp_path, suffix):
    out = render(solved(), tmp_path / f"t.{suffix}", "llama3-70b on D1-D4")
    data = out.read_bytes()
    assert len(data) > 20_000
    if suffix == "png":
        assert data.startswith(PNG_MAGIC)
    else:
        root = ET.fromstring(data)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        render(solved(), tmp_path / "t.jpg")
    old = solved()
    for d in old["devices"]:
        del d["compute_ms"]
    with pytest.raises(ValueError, match="no per-device timings"):
        render(old, tmp_path / "t.png")
    with pytest.raises(ValueError, match="infeasible"):
        journey({"infeasible": "no device can hold the head", "strategy": "halda", "solve_ms": 0.0})


@pytest.mark.slow  # a prima-ctl process
def test_prima_ctl_plan_timeline(tmp_path):
    store = tmp_path / "l70"
    res = ctl("synth", str(store), "--preset", "llama3-70b", "--manifest-only", "--bits-per-weight", "4.5")
    assert res.returncode == 0, res.stderr
    out = tmp_path / "plan.svg"
    res = ctl("plan", "--profiles", str(TESTBED), "--model", str(store), "--timeline", str(out), "--json")
    assert res.returncode == 0, res.stderr
    d2 = json.loads(res.stdout)["devices"][1]  # k = 5: D2 reads part of its loads ahead, part in its turns
    assert 0 < d2["inline_ms"] < d2["disk_ms"] and d2["loads_hidden"] is False
    assert ET.parse(out).getroot().tag.endswith("svg")
    res = ctl_here("plan", "--profiles", str(TESTBED), "--model", str(store), "--timeline", str(tmp_path / "x.gif"))
    assert res.returncode == 2 and "must end in .png or .svg" in res.stderr


def test_plans_saved_before_turn_ms_ask_to_be_solved_again():
    """The timeline draws the cost model's terms; it does not recompute them from an older plan's fields."""
    plan = solved("llama3-8b")
    old = {**plan, "devices": [{k: v for k, v in d.items() if k not in ("turn_ms", "cycle_ms")}
                               for d in plan["devices"]]}
    with pytest.raises(ValueError, match="solve it again"):
        journey(old)


def test_terms_add_up_to_the_predicted_tpot():
    for model, strategy in CASES:
        plan = solved(model, strategy)
        assert sum(plan["terms_ms"].values()) == pytest.approx(plan["predicted_tpot_ms"], rel=1e-9)
        assert plan["ring_ms"] == pytest.approx(plan["output_ms"] + sum(d["turn_ms"] + d["link_ms"]
                                                                        for d in plan["devices"]))
