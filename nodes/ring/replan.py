"""When the head re-plans a live ring because a device's owner took some of it: pure decisions, table-tested.

Each round the head samples every node's per-token time over the last few seconds (`measured_ms`) beside what the
plan assumed of it (`assumed_ms`: the cost model's figure for its windows, calibrated by what it measured when the
plan was new) and whether it gave memory back to its owner. A node that stays outside the dead band (slower than
`band` times, or - having been slower - faster than 1 / band times, what was assumed) for `hold_s` seconds is
acted on; so is one that asks for memory back, at once. After an action no drift acts for `min_interval_s` (no
flapping). The I/O - polling, solving, moving windows - is nodes/ring/replanner.py.
"""

import math
from dataclasses import dataclass, field, replace

from prima_rpc.spec.profiles import DeviceProfile

# A re-plan moves windows (each node re-reads its layers) and replays the requests in flight: about a second on a
# home ring's SSDs, plus the reads. Worth it when the tokens of the next HORIZON_S gain more than it costs.
HORIZON_S = 60.0
REPLAY_S = 1.0
MIN_GAIN = 0.1  # and the new plan must be at least 10 % faster: below that the prediction's own error decides

RATES = ("cpu_flops", "ram_bandwidth")  # what a busier CPU gives less of
TIMES = ("frame_s", "token_s", "output_s", "visit_s", "read_cpu_s", "read_loss_s", "stream_layer_s")


@dataclass(frozen=True)
class Settings:
    band: float = 2.5  # drift beyond x2.5 (or below /2.5) counts: an owner's real load, not a busy second
    hold_s: float = 6.0  # for this long without a break
    min_interval_s: float = 30.0  # between two actions


@dataclass(frozen=True)
class Sample:
    """One node in one round. measured_ms / assumed_ms: None when unknown (no decode frames, no plan yet)."""
    address: str
    measured_ms: float | None
    assumed_ms: float | None
    memory_low: bool = False
    scaled: bool = False  # the plan assumes it slower than profiled (an earlier re-plan moved load off it)

    @property
    def drift(self) -> float | None:
        """measured / assumed: 4.0 is four times slower than the plan assumed."""
        if not self.measured_ms or not self.assumed_ms:
            return None
        return self.measured_ms / self.assumed_ms


@dataclass(frozen=True)
class Act:
    """Re-plan because of `address`: its compute is `factor` times what the plan assumed (1.0: a memory re-plan)."""
    address: str
    reason: str  # "slower" | "faster" | "memory"
    factor: float
    measured_ms: float
    assumed_ms: float


@dataclass(frozen=True)
class Watch:
    """What the decisions remember between rounds."""
    since: dict[str, float] = field(default_factory=dict)  # node -> when its drift began (same direction)
    direction: dict[str, str] = field(default_factory=dict)  # node -> "slower" | "faster"
    last_act: float = -math.inf


def direction(x: Sample, band: float) -> str | None:
    """Which way a node drifted past the band. Faster counts only for a node the plan assumes slower than its
    profile: the owner's load went away and the plan moves back (a node never gets more than its profile says)."""
    drift = x.drift
    if drift is None:
        return None
    return "slower" if drift > band else "faster" if drift < 1 / band and x.scaled else None


def step(watch: Watch, samples: list[Sample], now: float, s: Settings = Settings()) -> tuple[Watch, Act | None]:
    """The next Watch, and the act this round calls for (None: keep the plan). A drift must hold in one direction
    for hold_s; a memory request acts at once; nothing acts within min_interval_s of the last act. Among nodes
    ready to act, the one that drifted most (in either direction) goes first."""
    since, dirs = {}, {}
    for x in samples:
        d = direction(x, s.band)
        if x.drift is None and x.address in watch.since:  # no time this round (too few tokens): the hold goes on
            since[x.address], dirs[x.address] = watch.since[x.address], watch.direction[x.address]
        elif d is not None:
            dirs[x.address] = d
            same = watch.direction.get(x.address) == d
            since[x.address] = watch.since[x.address] if same and x.address in watch.since else now
    watch = Watch(since, dirs, watch.last_act)
    low = [x for x in samples if x.memory_low]
    if low:  # the owner needs memory now: no wait (the node's request ends with the re-plan that answers it)
        x = low[0]
        return acted(watch, now), Act(x.address, "memory", 1.0, x.measured_ms or 0.0, x.assumed_ms or 0.0)
    if now - watch.last_act < s.min_interval_s:
        return watch, None
    ready = [x for x in samples if x.drift is not None and direction(x, s.band) == dirs.get(x.address)
             and x.address in since and now - since[x.address] >= s.hold_s]
    if not ready:
        return watch, None
    x = max(ready, key=lambda x: abs(math.log(x.drift)))
    return acted(watch, now), Act(x.address, dirs[x.address], x.drift, x.measured_ms, x.assumed_ms)


def acted(watch: Watch, now: float) -> Watch:
    """After an act (applied or not worth it): drifts start over, and the next act waits min_interval_s."""
    return Watch({}, {}, now)


CALIBRATION = 3  # samples whose median calibrates a node: one busy second of a shared machine does not


def calibration(measured: list[float], predicted_ms: float) -> float | None:
    """measured / the cost model's figure for a node, from its first CALIBRATION samples (None: not enough yet)."""
    if len(measured) < CALIBRATION or predicted_ms <= 0:
        return None
    return sorted(measured)[len(measured) // 2] / predicted_ms


def new_scale(scale: float, act: Act) -> float:
    """The compute factor the next plans assume of the node: scaled by the drift, never below its profile (1) nor
    past 64 times slower."""
    if act.reason == "memory":
        return scale
    return min(64.0, max(1.0, scale * act.factor))


def scaled(profile: DeviceProfile, factor: float) -> DeviceProfile:
    """The profile of a device whose compute takes `factor` times as long (an owner's load on its cores): its rates
    divided, its per-operation times multiplied. Its disk, memory and links are left as they are."""
    if factor <= 0 or not math.isfinite(factor):
        raise ValueError(f"a compute factor must be positive and finite, got {factor}")
    changes = {k: getattr(profile, k) / factor for k in RATES}
    changes |= {k: getattr(profile, k) * factor for k in TIMES}
    return replace(profile, **changes)


def with_memory(profile: DeviceProfile, ram: int) -> DeviceProfile:
    """The profile of a device that may now use only `ram` bytes (it gave the rest back to its owner)."""
    return replace(profile, ram_available=min(profile.ram_available, int(ram)))


def move_cost_s(moved_bytes: list[int], disk_rates: list[float]) -> float:
    """Seconds a re-plan takes: every node whose windows change re-reads them (in parallel), then the requests in
    flight replay."""
    reads = [b / r for b, r in zip(moved_bytes, disk_rates, strict=True) if b and r > 0]
    return max(reads, default=0.0) + REPLAY_S


def gain(old_tpot_ms: float, new_tpot_ms: float) -> float:
    """The share of each token's time the new plan saves (negative: it is slower)."""
    return 1.0 - new_tpot_ms / old_tpot_ms if old_tpot_ms > 0 else 0.0


def worth_it(old_tpot_ms: float, new_tpot_ms: float, cost_s: float, horizon_s: float = HORIZON_S) -> bool:
    """Apply the new plan when it is MIN_GAIN faster and the time it saves over the horizon beats its cost."""
    g = gain(old_tpot_ms, new_tpot_ms)
    return g >= MIN_GAIN and horizon_s * g > cost_s
