"""The head's decision about nodes that joined (nodes/ring/recovery.py), as a table: an idle ring grows into a joined
node that holds the model; a busy ring, a joined node without the model, or a member that does not answer waits."""

import pytest

from nodes.ring.recovery import Grow, Keep, MemberState, Probe, RingView, decide, member_states

UP, HOLDS, SILENT = Probe(True), Probe(True, True), Probe(False)


def view(joined, busy=False, members=("b", "c", "d")):
    return RingView("a", members, members, frozenset(), busy=busy, joined=frozenset(joined))


@pytest.mark.parametrize("snapshot, answers, expected", [
    (view({"d"}), {"b": HOLDS, "c": HOLDS, "d": HOLDS}, Grow(("d",), ("b", "c", "d"))),
    (view({"d"}, busy=True), {"b": HOLDS, "c": HOLDS, "d": HOLDS}, Keep()),  # requests in flight: later
    (view({"d"}), {"b": HOLDS, "c": HOLDS, "d": UP}, Keep()),  # no model: a relay until prima-ctl start
    (view({"d"}), {"b": SILENT, "c": HOLDS, "d": HOLDS}, Keep()),  # a member does not answer: not now
    (view(set()), {"b": HOLDS, "c": HOLDS, "d": HOLDS}, Keep()),
])
def test_grow(snapshot, answers, expected):
    assert decide(snapshot, answers) == expected


def test_a_joined_node_is_shown_joined_until_the_re_plan():
    states = member_states(view({"d"}), {"b": HOLDS, "c": HOLDS, "d": UP})
    assert states == [("a", MemberState.UP), ("b", MemberState.UP), ("c", MemberState.UP), ("d", MemberState.JOINED)]
