"""The plan a live ring runs now: its windows as the nodes report them, priced by the cost model on their profiles.

However the windows were chosen (`prima-ctl start` with Halda, a saved plan, `--windows`, a re-plan after a
node loss), this is the prediction for what the ring holds, so it can be set beside what the head measures.
"""

from prima_rpc.spec.windows import layer_ranges

NOT_ASSIGNED = "No plan is applied: the ring has no windows yet (prima-ctl start assigns them)."


class NoPlan(Exception):
    """The ring holds no assignment a plan could describe (nothing assigned yet, or windows not in plan order)."""


def assignment(nodes: list[tuple[str, object]]) -> tuple[int, list[int]]:
    """(k rounds per token, layers per round of each node in ring order) from the nodes' Info (head first)."""
    head = nodes[0][1]
    if head.role != "head" or not head.windows:
        raise NoPlan(NOT_ASSIGNED)
    k = len(head.windows)
    windows = [info.windows[0].stop - info.windows[0].start if info.windows else 0 for _, info in nodes]
    held = [[(r.start, r.stop) for r in info.windows] for _, info in nodes]
    if held != [[tuple(r) for r in rs] if w else [] for w, rs in zip(windows, layer_ranges(windows, head.n_layers))]:
        raise NoPlan("The ring's windows are not laid out as a plan's (k equal rounds, ranks 1..M-1 then the head).")
    return k, windows


def predict(head: str, token: str | None) -> dict:
    """The plan JSON of `solver.strategies.plan_to_json` (with its timings) for the windows the ring holds now.

    Profiles every node (cached per node; the first time they are measured, which takes a while);
    raises ring.RingError when a node cannot be reached or profiled, NoPlan when nothing is assigned."""
    from prima_rpc.app import ring
    from prima_rpc.app.live_plan import profile_ring
    from prima_rpc.spec.profiles import devices_from_json

    k, windows = assignment(ring.walk(head, token))
    profiles, manifest = profile_ring(head, token)
    if len(profiles["devices"]) != len(windows):
        raise NoPlan("The ring changed while it was profiled; ask again.")
    return priced(devices_from_json(profiles), manifest, k, windows)


def priced(devices: tuple, manifest: dict, k: int, windows: list[int]) -> dict:
    """The plan JSON of the assignment (k rounds, each device's window per round) on these profiles, with the KV
    room a node keeps under an explicit budget."""
    from nodes.engine.prefetch import KV_RESERVE_TOKENS  # torch and the solver: only when a prediction is asked for
    from solver.applied import priced as price

    return price(devices, manifest, k, windows, KV_RESERVE_TOKENS)
