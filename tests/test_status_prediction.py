"""`prima-ctl status` sets the applied plan's prediction beside what a real loopback ring measures."""

import json
from functools import partial

import pytest

from tests.ctl import ctl
from tests.rings import local_ring

WIDE = {"COLUMNS": "120"}  # room for the status table's prediction columns


def status(node: str) -> dict:
    res = ctl("--node", node, "status", "--json", env=WIDE)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def ring2(tiny_store, tmp_path_factory):
    with local_ring(tiny_store, 2, tmp_path_factory.mktemp("logs")) as local:
        yield local


@pytest.mark.slow
def test_status_shows_the_plans_prediction_beside_the_measured(ring2, tmp_path):
    head = ring2.addresses[0]
    at_head = partial(ctl, "--node", head, env=WIDE)
    res = at_head("start", "--windows", "2,2")
    assert res.returncode == 0, res.stderr
    before = status(head)  # no plan's prediction: the fields are there, empty, and the table has no such columns
    assert before["predicted_tpot_ms"] is None and all(n["predicted_ms"] is None for n in before["nodes"])
    assert "pred" not in at_head("status").stdout
    # A plan as `prima-ctl plan --out` saves it (only the fields start reads; the figures are the plan's own).
    plan = {"strategy": "halda", "k": 1, "predicted_tpot_ms": 12.5, "solve_ms": 1.0,
            "devices": [{"name": "n0", "role": "head", "window": 2, "buffer_layers": 0.0, "turn_ms": 3.25},
                        {"name": "n1", "role": "worker", "window": 2, "buffer_layers": 0.0, "turn_ms": 4.5}]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    res = at_head("start", "--plan", str(path))
    assert res.returncode == 0, res.stderr
    res = at_head("generate", "hello", "--max-tokens", "6", "--temperature", "0", "--json")
    assert res.returncode == 0, res.stderr
    after = status(head)
    assert [n["predicted_ms"] for n in after["nodes"]] == [3.25, 4.5]
    assert after["predicted_tpot_ms"] == 12.5 and after["measured_tpot_ms"] > 0
    for n in after["nodes"]:  # every node timed its own decode frames since the assignment
        assert n["measured_ms"] > 0 and n["predicted_tpot_ms"] == 12.5
        for key in ("compute_s", "stall_s", "frames", "last_token_ms", "windows", "state"):  # the existing fields
            assert key in n
    table = at_head("status").stdout
    assert "pred" in table and "meas" in table and "TPOT predicted 12.5 ms" in table
    # A plan's prediction is for its own windows: a new assignment without one clears it.
    assert at_head("start", "--windows", "3,1").returncode == 0
    again = status(head)
    assert again["predicted_tpot_ms"] is None and all(n["measured_ms"] is None for n in again["nodes"])
