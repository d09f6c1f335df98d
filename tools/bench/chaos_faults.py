"""The chaos soak's faults: each kind a function that does it to the ring (or says it cannot now), chosen by a
seeded schedule one every A-B seconds. Kinds that need the home testbed's shaper or devices (a link cut, a
latency spike, a memory hog) are registered with `testbed=True` and skipped on a plain loopback ring, said once."""

import random
from collections.abc import Callable
from dataclasses import dataclass

from prima_rpc.app import ring
from tools.bench.chaos_ring import ChaosRing

MIN_MEMBERS = 2  # a kill or a leave leaves at least this many running members (a head and its standby)


class NotNow(Exception):
    """This kind cannot be done to the ring as it is now (too few members, nothing dead to restart)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    apply: Callable[[ChaosRing, random.Random, float], str]  # (ring, rng, longest pause s) -> what was done
    testbed: bool = False  # needs the home testbed (python -m tools.testbed): skipped on a loopback ring


def _members(chaos: ChaosRing) -> list[str]:
    """Running members in ring order, the head first (relays included)."""
    running = set(chaos.running())
    return [a for a, _, info in chaos.status() if info is not None and a in running]


def _spare(chaos: ChaosRing, n: int = 1) -> list[str]:
    members = _members(chaos)
    if len(members) - n < MIN_MEMBERS or chaos.stopped:  # a stopped node may be the one the ring leans on
        raise NotNow(f"{len(members)} running members, {len(chaos.stopped)} stopped")
    return members


def kill_worker(chaos: ChaosRing, rng: random.Random, _: float) -> str:
    members = _spare(chaos)
    workers = members[2:]
    if not workers:
        raise NotNow("no worker besides the head and its standby")
    victim = rng.choice(workers)
    chaos.kill(victim)
    return f"SIGKILL worker {victim}"


def kill_head(chaos: ChaosRing, rng: random.Random, _: float) -> str:
    head = _spare(chaos)[0]
    chaos.kill(head)
    return f"SIGKILL head {head}"


def kill_standby(chaos: ChaosRing, rng: random.Random, _: float) -> str:
    standby = _spare(chaos)[1]
    chaos.kill(standby)
    return f"SIGKILL standby {standby}"


def sigstop(chaos: ChaosRing, rng: random.Random, longest: float) -> str:
    if chaos.stopped:
        raise NotNow("a node is stopped already")
    victim = rng.choice(_members(chaos))
    seconds = rng.uniform(5, max(5.0, min(30.0, longest)))
    chaos.stop_for(victim, seconds)
    return f"SIGSTOP {victim} for {seconds:.0f} s"


def join(chaos: ChaosRing, rng: random.Random, _: float) -> str:
    if sum(1 for m in chaos.nodes.values() if m.name.startswith("joiner") and m.proc.poll() is None) >= 2:
        raise NotNow("two joiners in the ring already")
    via = rng.choice(chaos.running())
    return f"join {chaos.join(via)} via {via}"


def leave(chaos: ChaosRing, rng: random.Random, _: float) -> str:
    members = _spare(chaos)
    if len(members) < 3:
        raise NotNow("no member to leave but the head and its standby")
    victim = rng.choice(members[2:])
    res = chaos.ctl("--node", members[0], "leave", victim)
    if res.returncode != 0:
        return f"leave {victim} refused: {res.stderr.strip().splitlines()[-1:]}"
    chaos.nodes[victim].gone = True
    chaos.nodes[victim].proc.wait(30)
    return f"leave {victim}"


def restart(chaos: ChaosRing, rng: random.Random, _: float) -> str:
    dead = chaos.dead()
    if dead:
        victim = rng.choice(sorted(dead))
        chaos.restart(victim)
        return f"restart {victim} (was dead) with its store"
    members = _spare(chaos)
    victim = rng.choice(members[1:])
    chaos.restart(victim)
    return f"restart {victim} (SIGTERM, then its command again) with its store"


def replan(chaos: ChaosRing, rng: random.Random, _: float) -> str:
    if chaos.stopped:
        raise NotNow("a node is stopped: a start would wait for it")
    walked = [a for a, _ in ring.walk(chaos.head_and_standby()[0])]
    n_layers = chaos.info(walked[0]).n_layers
    cuts = sorted(rng.sample(range(1, n_layers), len(walked) - 1)) if len(walked) <= n_layers else []
    if not cuts and len(walked) > 1:
        raise NotNow("more members than layers")
    windows = [b - a for a, b in zip([0, *cuts], [*cuts, n_layers])]
    res = chaos.ctl("--node", walked[0], "start", "--windows", ",".join(map(str, windows)))
    if res.returncode != 0:
        return f"start --windows {windows} failed: {res.stderr.strip().splitlines()[-1:]}"
    return f"start --windows {','.join(map(str, windows))}"


def _testbed_only(what: str):
    def apply(chaos: ChaosRing, rng: random.Random, _: float) -> str:
        raise NotNow(f"{what} needs the home testbed")
    return apply


FAULTS = [Fault("kill_worker", kill_worker), Fault("kill_head", kill_head), Fault("kill_standby", kill_standby),
          Fault("sigstop", sigstop), Fault("join", join), Fault("leave", leave), Fault("restart", restart),
          Fault("replan", replan),
          Fault("link_cut", _testbed_only("a link cut (the shaper)"), testbed=True),
          Fault("latency_spike", _testbed_only("a +200 ms spike (the shaper)"), testbed=True),
          Fault("memory_hog", _testbed_only("a memory hog on one device"), testbed=True)]


def choose(faults: list[Fault], chaos: ChaosRing, rng: random.Random, longest: float) -> tuple[str, str]:
    """Do one fault the seeded rng picks among those the ring allows now; (kind, what was done), ("", why not)."""
    left = [f for f in faults]
    rng.shuffle(left)
    why = []
    for fault in left:
        try:
            return fault.kind, fault.apply(chaos, rng, longest)
        except NotNow as exc:
            why.append(f"{fault.kind}: {exc}")
    return "", "; ".join(why)
