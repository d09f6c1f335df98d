"""A node's layer windows: their sizes (layers per device per round), the half-open ranges they make in
prima.cpp's order, and where a frame goes next (pure decisions, tested with tables)."""

from dataclasses import dataclass
from enum import Enum


def layer_ranges(window_sizes: list[int], n_layers: int) -> list[list[tuple[int, int]]]:
    """Half-open layer ranges per device (ring order, head first) in prima.cpp order: each round
    goes to ranks 1..M-1 and then rank 0, so the head holds the last window of every round."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if any(w < 0 for w in window_sizes):
        raise ValueError(f"window_sizes must be >= 0, got {window_sizes}")
    W = sum(window_sizes)
    if W == 0:
        raise ValueError(f"at least one window must be > 0, got {window_sizes}")
    if n_layers % W:
        raise ValueError(f"sum(window_sizes)={W} does not divide n_layers={n_layers}")
    out: list[list[tuple[int, int]]] = [[] for _ in window_sizes]
    order = list(range(1, len(window_sizes))) + [0]
    start = 0
    for _ in range(n_layers // W):  # rounds
        for m in order:
            if window_sizes[m]:
                out[m].append((start, start + window_sizes[m]))
                start += window_sizes[m]
    return out


def even_windows(n_layers: int, nodes: int) -> list[int]:
    """Window sizes of one round (k = 1) as even as the layer count allows; the head (first) takes the
    remainder."""
    base, extra = divmod(n_layers, nodes)
    return [base + extra] + [base] * (nodes - 1)

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
