"""Where a frame goes next: pure decisions from a node's windows, tested with tables."""

from dataclasses import dataclass
from enum import Enum


class Step(Enum):
    COMPUTE = "compute"  # run this node's window(s) starting at next_layer
    DELIVER = "deliver"  # the head: all layers done, sample
    FORWARD = "forward"  # pass to the successor unchanged


@dataclass(frozen=True)
class Windows:
    """A node's half-open layer windows of one ring assignment."""

    ranges: tuple[tuple[int, int], ...]
    n_layers: int
    head: bool

    def __post_init__(self):
        last = -1
        for start, stop in sorted(self.ranges):
            if not (0 <= start < stop <= self.n_layers) or start < last:
                raise ValueError(f"bad windows {list(self.ranges)} for {self.n_layers} layers: "
                                 "need 0 <= start < stop <= L, not overlapping")
            last = stop

    @property
    def relay(self) -> bool:
        return not self.ranges and not self.head

    def layers(self) -> list[int]:
        return [i for start, stop in self.ranges for i in range(start, stop)]

    def run_from(self, next_layer: int) -> list[tuple[int, int]]:
        """The consecutive windows this node computes for a frame at next_layer."""
        starts = dict(self.ranges)
        out = []
        while next_layer in starts:
            out.append((next_layer, starts[next_layer]))
            next_layer = starts[next_layer]
        return out

    def step(self, next_layer: int) -> Step:
        if self.run_from(next_layer):
            return Step.COMPUTE
        if self.head and next_layer == self.n_layers:
            return Step.DELIVER
        return Step.FORWARD

    def check_received(self, next_layer: int) -> str | None:
        """Why a frame from the predecessor cannot be for this node, or None if it can."""
        if next_layer > self.n_layers:
            return f"next_layer {next_layer} is beyond the model's {self.n_layers} layers"
        if self.relay:
            return None
        if self.step(next_layer) is Step.FORWARD:
            return f"layer {next_layer} is outside this node's windows {[list(r) for r in self.ranges]}"
        return None
