"""Which head gives way on a split brain, and how many misses make a node lost: pure decisions, tested with tables."""

import pytest

from nodes.ring import recovery
from nodes.ring.recovery import Keep, Probe, RingView, RouteAround

H, A, B = "h:1", "a:1", "b:1"


@pytest.mark.parametrize("epoch, heard, expected", [
    # every member follows this head: nothing to give way to
    (5, {A: (H, 5), B: (H, 5)}, None),
    # a member assigned by this head's re-plan before the head itself: the same head, so no split
    (5, {A: (H, 6)}, None),
    # the standby took over while this head was cut off: a newer ring with another head
    (5, {A: (A, 6), B: (A, 6)}, (A, 6)),
    # a member that still follows an older ring of another head does not count
    (5, {A: (B, 4)}, None),
    # two heads re-planned in the same millisecond: the greater address wins, on both sides alike
    (5, {A: (A, 5)}, None),
    (5, {A: ("z:1", 5)}, ("z:1", 5)),
    # the newest of several
    (5, {A: (A, 7), B: (B, 9)}, (B, 9)),
    # a node that follows no head yet (fresh, idle)
    (5, {A: ("", 0)}, None),
])
def test_newer_ring(epoch, heard, expected):
    assert recovery.newer_ring(H, epoch, heard) == expected


def test_each_side_of_a_split_agrees_which_head_stays():
    """The old head and the new one each see the other's ring; exactly one of them gives way."""
    old, new = (H, 5), (A, 6)
    assert recovery.newer_ring(old[0], old[1], {A: new}) == new
    assert recovery.newer_ring(new[0], new[1], {H: old}) is None


def test_a_loading_member_has_more_misses_before_it_is_lost():
    view = RingView(H, (A, B), (A, B), frozenset(), ((A, 2), (B, 2)))
    loading = {A: Probe(False, loading=True), B: Probe(False)}
    assert recovery.decide(view, loading) == RouteAround((B,), (A,))
    view5 = RingView(H, (A, B), (A, B), frozenset(), ((A, recovery.MISSES_LOADING), (B, 0)))
    assert recovery.decide(view5, {A: Probe(False, loading=True), B: Probe(True, True)}) == RouteAround((A,), (B,))
    assert recovery.decide(RingView(H, (A,), (A,), frozenset(), ((A, 1),)), {A: Probe(False, loading=True)}) == Keep()


@pytest.mark.parametrize("busy, loading, allowed", [
    (False, False, recovery.MISSES_IDLE), (True, False, recovery.MISSES_BUSY), (True, True, recovery.MISSES_LOADING),
])
def test_misses_allowed(busy, loading, allowed):
    assert recovery.misses_allowed(busy, loading) == allowed
