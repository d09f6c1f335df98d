"""What the head does about its members: pure decisions from a frozen snapshot, tested with tables.

The head probes every member each second (nodes/ring/members.py performs the effects). A member that
misses enough probes in a row is routed around: the survivors are rewired and re-planned under a
new epoch, and waiting requests replay. A lost member that answers again rejoins in its old place
once the ring is idle, and a node that joined (a relay before the head) takes layers in the first idle
re-plan when it holds the ring's model. Nothing here does I/O.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from prima_rpc.spec.windows import even_windows, layer_ranges

MISSES_IDLE = 2  # an idle ring waits for a second miss: a loaded machine may answer one probe late
MISSES_BUSY = 1  # requests wait on the ring: the first miss counts
MISSES_LOADING = 5  # its last answer said it loads an assignment, which can keep it from answering for seconds


class MemberState(Enum):
    UP = "up"
    LOST = "lost"
    REJOINING = "rejoining"  # lost, answers again, not yet re-planned in
    JOINED = "joined"  # joined the running ring as a relay; takes layers at the next re-plan


@dataclass(frozen=True)
class Probe:
    """One member's answer to a probe (None: it did not answer)."""

    answered: bool
    holds_model: bool = False  # has the ring's model, so it can take layers
    loading: bool = False  # it fetches or loads an assignment (a miss keeps the last answer's)


@dataclass(frozen=True)
class RingView:
    """The head's snapshot of its ring."""

    head: str  # as its predecessor dials it
    members: tuple[str, ...]  # the ring now, in order, without the head
    original: tuple[str, ...]  # the ring as prima-ctl started it (the order lost members rejoin in)
    lost: frozenset[str]
    misses: tuple[tuple[str, int], ...] = ()  # consecutive unanswered probes per address
    busy: bool = False  # requests are in flight
    joined: frozenset[str] = frozenset()  # joined since the last plan, relays until a re-plan


@dataclass(frozen=True)
class Keep:
    pass


@dataclass(frozen=True)
class RouteAround:
    lost: tuple[str, ...]
    survivors: tuple[str, ...]


@dataclass(frozen=True)
class Rejoin:
    back: tuple[str, ...]
    order: tuple[str, ...]  # the new ring without the head


@dataclass(frozen=True)
class Grow:
    joined: tuple[str, ...]
    order: tuple[str, ...]  # the new ring without the head


Decision = Keep | RouteAround | Rejoin | Grow


def probed(view: RingView) -> tuple[str, ...]:
    """Whom the head probes this round: its members, then the lost ones (to see them come back)."""
    return view.members + tuple(sorted(view.lost - set(view.members)))


def tally(misses: Mapping[str, int], answers: Mapping[str, Probe]) -> tuple[tuple[str, int], ...]:
    """Consecutive misses after this round's answers; an answer resets the count."""
    return tuple((a, 0 if p.answered else misses.get(a, 0) + 1) for a, p in answers.items())


def misses_allowed(busy: bool, loading: bool) -> int:
    """Consecutive misses after which a member (or, to its members, the head) counts as lost."""
    return MISSES_LOADING if loading else MISSES_BUSY if busy else MISSES_IDLE


def decide(view: RingView, answers: Mapping[str, Probe]) -> Decision:
    misses = dict(view.misses)
    lost = tuple(a for a in view.members
                 if misses.get(a, 0) >= misses_allowed(view.busy, answers.get(a, Probe(False)).loading))
    if lost:
        return RouteAround(lost, tuple(a for a in view.members if a not in lost))
    back = tuple(a for a in sorted(view.lost) if answers.get(a, Probe(False)).answered)
    if back and not view.busy:
        order = tuple(a for a in view.original if a not in view.lost or a in back)
        if all(answers.get(a, Probe(False)).answered for a in order):
            return Rejoin(back, order)
    return _grow(view, answers)


def _grow(view: RingView, answers: Mapping[str, Probe]) -> Decision:
    """An idle ring re-plans with the nodes that joined once one of them holds the model (one without it stays a
    relay until prima-ctl start gives it layers to fetch); every member must answer."""
    joined = tuple(a for a in view.members if a in view.joined)
    if not joined or view.busy or not all(answers.get(a, Probe(False)).answered for a in view.members):
        return Keep()
    if any(answers[a].holds_model for a in joined):
        return Grow(joined, view.members)
    return Keep()


def member_states(view: RingView, answers: Mapping[str, Probe]) -> list[tuple[str, MemberState]]:
    """Every member in ring order, the head first, lost ones in their original place."""
    order = list(view.original) or list(view.members)
    order += [a for a in view.members if a not in order]
    out = [(view.head, MemberState.UP)]
    for a in order:
        if a not in view.lost:
            out.append((a, MemberState.JOINED if a in view.joined else MemberState.UP))
        elif answers.get(a, Probe(False)).answered:
            out.append((a, MemberState.REJOINING))
        else:
            out.append((a, MemberState.LOST))
    return out


def new_head(ring: tuple[str, ...], lost_head: str, copies: Mapping[str, bool]) -> str | None:
    """Whom the survivors make their head when `lost_head` (ring[0]) is gone: the first member after it in ring
    order that answers (is in `copies`) with a complete copy of the head's units; None: no member can."""
    return next((a for a in ring if a != lost_head and copies.get(a, False)), None)


def newer_ring(head: str, epoch: int, heard: Mapping[str, tuple[str, int]]) -> tuple[str, int] | None:
    """The ring a head gives way to (split brain: it was cut off, and a member took over meanwhile): heard maps each
    member that answered to (the head it follows, its epoch); a member that follows another head at a greater
    (epoch, head address) than this head's wins, the greatest of them. Both sides of a split compare the same pairs,
    so exactly one head stays. None: no member follows a newer ring."""
    newer = [(e, h) for h, e in heard.values() if h and h != head and (e, h) > (epoch, head)]
    return (max(newer)[1], max(newer)[0]) if newer else None


@dataclass(frozen=True)
class Replan:
    """A new ring: who follows whom and which layers each holds (an even split over model holders)."""

    peers: tuple[tuple[str, str], ...]  # (member, its new successor), the head first
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # per ring position, the head first; () = relay


def replan(head: str, members: Mapping[str, Probe], n_layers: int) -> Replan:
    """members: the new ring without the head, in order (dict order), with their probes."""
    ring = [head, *members]
    holders = [a for a, p in members.items() if p.holds_model]
    sizes = even_windows(n_layers, 1 + len(holders))  # the head first
    windows = [sizes[0]] + [sizes[1 + holders.index(a)] if a in holders else 0 for a in members]
    ranges = layer_ranges(windows, n_layers)
    peers = tuple((a, ring[(i + 1) % len(ring)]) for i, a in enumerate(ring))
    return Replan(peers, tuple(tuple(r) for r in ranges))
