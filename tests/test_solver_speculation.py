"""The speculative TPOT model: tokens per trip, and when speculating pays."""

import pytest

from solver.speculation import best_draft, speculative_tpot, tokens_per_trip


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
