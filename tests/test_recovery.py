"""The head's recovery decisions, pure functions of a snapshot: tables of rings and probe answers."""

import grpc
import pytest

from nodes.ring import frames, recovery
from nodes.ring.recovery import Keep, MemberState, Probe, Rejoin, RingView, RouteAround

UP, DOWN = Probe(True, True), Probe(False)
A, B, C = "a:1", "b:1", "c:1"


def view(members=(A, B), lost=(), misses=(), busy=False, original=(A, B)):
    return RingView("h:1", tuple(members), tuple(original), frozenset(lost), tuple(misses), busy)


@pytest.mark.parametrize("snapshot, answers, expected", [
    # everyone answers: nothing to do
    (view(), {A: UP, B: UP}, Keep()),
    # an idle ring waits for a second miss before it routes round a member
    (view(misses=((B, 1),)), {A: UP, B: DOWN}, Keep()),
    (view(misses=((B, 2),)), {A: UP, B: DOWN}, RouteAround((B,), (A,))),
    # requests in flight: the first miss counts
    (view(misses=((A, 1),), busy=True), {A: DOWN, B: UP}, RouteAround((A,), (B,))),
    # both lost: the head is left alone
    (view(misses=((A, 2), (B, 2))), {A: DOWN, B: DOWN}, RouteAround((A, B), ())),
    # a lost member answers again on an idle ring: it rejoins in its original place
    (view(members=(B,), lost=(A,)), {B: UP, A: UP}, Rejoin((A,), (A, B))),
    # ... but not while requests are in flight
    (view(members=(B,), lost=(A,), busy=True), {B: UP, A: UP}, Keep()),
    # ... nor while it is still silent
    (view(members=(B,), lost=(A,)), {B: UP, A: DOWN}, Keep()),
    # two lost, one back: it rejoins, the other stays out
    (view(members=(C,), lost=(A, B), original=(A, B, C)), {C: UP, A: DOWN, B: UP}, Rejoin((B,), (B, C))),
    # a current member missing its first probe holds the rejoin back (the next round decides)
    (view(members=(B,), lost=(A,), misses=((B, 1),)), {B: DOWN, A: UP}, Keep()),
])
def test_decide(snapshot, answers, expected):
    assert recovery.decide(snapshot, answers) == expected


@pytest.mark.parametrize("misses, answers, expected", [
    ({}, {A: UP, B: DOWN}, ((A, 0), (B, 1))),
    ({B: 1}, {A: UP, B: DOWN}, ((A, 0), (B, 2))),
    ({A: 3}, {A: UP}, ((A, 0),)),
])
def test_tally_counts_consecutive_misses(misses, answers, expected):
    assert recovery.tally(misses, answers) == expected


@pytest.mark.parametrize("snapshot, answers, expected", [
    (view(), {}, [("h:1", "up"), (A, "up"), (B, "up")]),
    (view(members=(B,), lost=(A,)), {A: DOWN}, [("h:1", "up"), (A, "lost"), (B, "up")]),
    (view(members=(B,), lost=(A,)), {A: UP}, [("h:1", "up"), (A, "rejoining"), (B, "up")]),
    (view(members=(), original=()), {}, [("h:1", "up")]),
])
def test_member_states_in_ring_order(snapshot, answers, expected):
    assert [(a, s.value) for a, s in recovery.member_states(snapshot, answers)] == expected
    assert all(isinstance(s, MemberState) for _, s in recovery.member_states(snapshot, answers))


def test_probed_includes_the_lost():
    assert recovery.probed(view(members=(B,), lost=(A,))) == (B, A)


@pytest.mark.parametrize("members, n_layers, peers, ranges", [
    ({A: UP, B: UP}, 30, (("h:1", A), (A, B), (B, "h:1")), (((20, 30),), ((0, 10),), ((10, 20),))),
    ({B: UP}, 30, (("h:1", B), (B, "h:1")), (((15, 30),), ((0, 15),))),
    ({}, 30, (("h:1", "h:1"),), (((0, 30),),)),
    # a member without the model relays
    ({A: Probe(True, False), B: UP}, 30, (("h:1", A), (A, B), (B, "h:1")), (((15, 30),), (), ((0, 15),))),
])
def test_replan_splits_evenly_over_model_holders(members, n_layers, peers, ranges):
    plan = recovery.replan("h:1", members, n_layers)
    assert plan.peers == peers and plan.ranges == ranges


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_statuses_round_trip_the_wire(code):
    expected = grpc.StatusCode.UNKNOWN if code is grpc.StatusCode.OK else code  # an ERROR is never OK
    frame = frames.error("r", code, "why", 3)
    assert frames.status_from_wire(frame.code) is expected


def test_an_unknown_wire_status_reads_unknown():
    assert frames.status_from_wire(99) is grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize("copies, expected", [
    ({A: True, B: True}, A),  # the head's successor first
    ({A: False, B: True}, B),  # the first with a complete copy of the head's units
    ({B: True}, B),  # A does not answer
    ({A: False, B: False}, None),  # nobody can take over
    ({"h:1": True, B: True}, B),  # the lost head never chooses itself
])
def test_new_head_is_the_first_member_in_ring_order_with_a_complete_copy(copies, expected):
    assert recovery.new_head(("h:1", A, B), "h:1", copies) == expected
