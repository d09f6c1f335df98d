"""Where a node's time goes: running totals (seconds, count) of named spans of its hot path, read by its metrics."""

from collections import defaultdict


class Spans:
    """Totals by span name. Written on the event loop thread only (the compute pool reports through it), so
    the totals need no lock; a scrape reads a copy."""

    def __init__(self):
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.counts: defaultdict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.counts[name] += 1

    def snapshot(self) -> dict[str, tuple[float, int]]:
        """name -> (seconds, count) so far."""
        return {name: (self.seconds[name], self.counts[name]) for name in list(self.seconds)}
