"""heteropipe closed forms vs a brute-force discrete-event simulation, plus their corollaries."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.event_sim import simulate_pipeline
from solver.pipeline import (
    MODES,
    gpipe_makespan,
    homogeneity_bias,
    makespan,
    overlap_ratio,
    phase_transition,
)

times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)
quarters = st.integers(0, 40).map(lambda i: i / 4)  # exact in binary: ties compare exactly


@st.composite
def pipelines(draw, values=times):
    S = draw(st.integers(1, 6))
    tau = draw(st.lists(values, min_size=S, max_size=S))
    d = draw(st.lists(values, min_size=S, max_size=S))
    return tau, d, draw(st.integers(1, 8))


@settings(max_examples=300, deadline=None, database=None)
@given(pipelines(), st.sampled_from(MODES))
def test_closed_forms_match_event_simulation(case, mode):
    tau, d, M = case
    assert makespan(tau, d, M, mode) == pytest.approx(simulate_pipeline(tau, d, M, mode), rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None, database=None)
@given(pipelines(quarters))
def test_sandwich_and_bias(case):
    tau, d, M = case
    free, asyn, block = (makespan(tau, d, M, m) for m in MODES)
    assert free <= asyn + 1e-12 <= block + 2e-12  # communication only adds; blocking is worst
    assert gpipe_makespan(tau, M) - free == pytest.approx(homogeneity_bias(tau), abs=1e-9)
    # Cor. 4: the blocking slope exceeds max(tau) exactly when some link is over its slack.
    sig = max([t + x for t, x in zip(tau[:-1], d[:-1])] + [tau[-1]])
    assert (sig > max(tau)) == bool(phase_transition(tau, d))


def test_heteropipe_worked_example():
    tau = [0.5, 1.0, 1.0, 5.0]
    assert makespan(tau, None, 1, "free") == 7.5
    assert makespan(tau, None, 8, "free") == 42.5
    assert gpipe_makespan(tau, 8) == 55.0
    assert homogeneity_bias(tau) == 12.5
    d = [4.6, 0.1, 0.1, 0.0]  # heteropipe's three links, no delivery hop
    assert makespan(tau, d, 8, "async") == pytest.approx(47.3)
    assert makespan(tau, d, 8, "blocking") == pytest.approx(48.0)
    assert phase_transition(tau, d) == [0]
    assert phase_transition(tau, [4.4, 0.1, 0.1, 0.0]) == []


def test_delivery_hop_is_added_once_and_never_blocks():
    tau, d = [1.0, 2.0], [0.5, 3.0]
    assert makespan(tau, d, 4, "async") == 3 * 2.0 + 3.0 + 3.5
    assert makespan(tau, d, 4, "blocking") == 3 * 2.0 + (1.5 + 2.0) + 3.0
    assert phase_transition(tau, d) == []  # d[-1] is not a stage link


def test_overlap_ratio():
    tau, d, M = [1.0, 1.0, 3.0], [2.5, 0.2, 0.0], 5
    t_async, t_block = makespan(tau, d, M, "async"), makespan(tau, d, M, "blocking")
    assert overlap_ratio(tau, d, M, t_async) == pytest.approx(1.0)
    assert overlap_ratio(tau, d, M, t_block) == pytest.approx(0.0)
    assert overlap_ratio(tau, d, M, (t_async + t_block) / 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="undefined"):
        overlap_ratio(tau, d, 1, t_async)


@pytest.mark.parametrize("call, msg", [
    (lambda: makespan([], [], 1, "free"), "at least one stage"),
    (lambda: makespan([1.0, 2.0], [1.0], 1, "async"), "len\\(d\\) must equal len\\(tau\\)"),
    (lambda: makespan([1.0], [1.0], 0, "async"), "M must be an int >= 1"),
    (lambda: makespan([1.0], [1.0], 2.0, "async"), "M must be an int >= 1"),
    (lambda: makespan([1.0], [1.0], True, "async"), "M must be an int >= 1"),
    (lambda: makespan([1.0], [1.0], 1, "sync"), "mode must be one of"),
    (lambda: makespan([-1.0], [1.0], 1, "free"), "tau must be finite and >= 0"),
    (lambda: makespan([1.0], [float("inf")], 1, "async"), "d must be finite and >= 0"),
    (lambda: gpipe_makespan([1.0], 0), "M must be"),
    (lambda: overlap_ratio([1.0, 1.0], [5.0, 0.0], 3, -1.0), "t_real must be finite"),
])
def test_validation(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()
