"""What the chaos soak checks and measures: a ring that has a head again, a healthy ring at the end (one head,
every running node a member, windows that cover every layer once, a prefix cache that gives the reference's
answer), resource growth, percentiles."""

import time

import psutil

from tools.bench.chaos_load import send
from tools.bench.chaos_ring import ChaosRing, anon_rss, open_fds

SETTLE_S = 120.0


def even_windows(n_layers: int, n: int) -> list[int]:
    return [n_layers // n + (i < n_layers % n) for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def process_resources(proc) -> tuple[int, int, int, int]:
    p = psutil.Process(proc.pid)
    return p.pid, anon_rss(p.pid), open_fds(p.pid), 0


def growth(before: dict, after: dict) -> tuple[float, float]:
    """The worst relative growth of RSS and of open fds over the processes alive (the same pid) at both ends. RSS
    is anonymous (RssAnon) and counts beyond the weights a node holds (a survivor of a leave takes more layers,
    which is no leak): the growth of RSS minus weights, over the starting RSS."""
    rss, fds = [0.0], [0.0]
    for name, (pid, rss0, fds0, weights0) in before.items():
        end = after.get(name)
        if end is not None and end[0] == pid:
            rss.append(((end[1] - end[3]) - (rss0 - weights0)) / rss0)
            fds.append((end[2] - fds0) / fds0)
    return max(rss), max(fds)


def wait_for_head(chaos: ChaosRing, seconds: float) -> bool:
    """Wait until a running node is a loaded head (a failover or a re-plan done), for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for address in chaos.running():
            info = chaos.info(address)
            if info is not None and info.role == "head" and info.loaded:
                return True
        time.sleep(0.5)
    return False


def _view(chaos: ChaosRing) -> dict:
    """One look at the ring: the problems found (none: healthy)."""
    problems = {}
    if exited := chaos.exited():
        problems["ended on their own"] = exited
    infos = {a: chaos.info(a) for a in chaos.running()}
    silent = [a for a, i in infos.items() if i is None]
    if silent:
        problems["silent"] = silent
    heads = sorted(a for a, i in infos.items() if i is not None and i.role == "head")
    if len(heads) != 1:
        problems["heads"] = heads
        return problems
    head = infos[heads[0]]
    followers = {a: i.head for a, i in infos.items() if i is not None and i.head != heads[0]}
    if followers:
        problems["follow another head"] = followers
    listed = {m.address: m.state for m in head.members}
    missing = {a: listed.get(a, "absent") for a in infos if listed.get(a) not in ("up", "joined")}
    if missing:
        problems["not members"] = missing
    ranges = sorted((r.start, r.stop) for i in infos.values() if i is not None for r in i.windows)
    covered = 0
    for start, stop in ranges:
        if start != covered:
            problems["windows"] = ranges
            break
        covered = stop
    if covered != head.n_layers and "windows" not in problems:
        problems["windows"] = ranges
    return problems


def healthy(chaos: ChaosRing, root: str, expected: dict[str, str]) -> dict:
    """Wait up to SETTLE_S for a healthy ring; then the prefix cache: the long prompt twice (its second a hit)
    answers the reference's text. {"healthy": bool, ...what is wrong}."""
    deadline = time.monotonic() + SETTLE_S
    while (problems := _view(chaos)) and time.monotonic() < deadline:
        time.sleep(1.0)
    if problems:
        return {"healthy": False, **problems}
    answers = [send(root, "long-prompt") for _ in range(2)]
    head = next(i for a in chaos.running() if (i := chaos.info(a)) is not None and i.role == "head")
    wrong = [a.why or a.answer[:200] for a in answers if a.kind != "ok" or a.answer != expected["long-prompt"]]
    if wrong:
        return {"healthy": False, "prefix cache": wrong}
    held = {a: f"{i.stats.active_requests} requests' KV, {i.stats.prefix_cached_tokens} prefix positions"
            for a in chaos.running() if (i := chaos.info(a)) is not None}  # what memory the nodes still hold
    return {"healthy": True, "prefix_hit_tokens": head.stats.prefix_hit_tokens,
            "settled_in_s": round(SETTLE_S - (deadline - time.monotonic()), 1), "held": held}
