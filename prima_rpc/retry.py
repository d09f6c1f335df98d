"""Back-off for calls that meet a ring mid-change (a failover, a re-plan, a node loading): which gRPC statuses
are worth another try, and the pauses between tries until a deadline. Used by `prima-node --join` and prima-ctl."""

import os
import random
import time
from collections.abc import Iterator

import grpc

# A node lost or not yet replaced (UNAVAILABLE), one too busy re-planning to answer in time (DEADLINE_EXCEEDED), a
# ring that changed under the call (ABORTED). Everything else (a bad argument, a wrong token, another model, a ring
# that was never started) is the same on the next try.
RETRIABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})
SETTLE_S = 60.0  # a failover settles within ~15 s and a re-plan's loads within seconds: room for both, and slack


def settle_seconds() -> float:
    """How long a caller waits for a ring to settle: PRIMA_RETRY_S, else SETTLE_S (0: no retries)."""
    text = os.environ.get("PRIMA_RETRY_S", "")
    try:
        return max(0.0, float(text)) if text else SETTLE_S
    except ValueError:
        return SETTLE_S


def pauses(seconds: float, first: float = 0.25, most: float = 2.0) -> Iterator[float]:
    """Pauses between tries, doubling from `first` to `most` (jittered, so that callers spread out), for as long
    as the next try still starts within `seconds` from now; the caller sleeps each one before its next try."""
    deadline = time.monotonic() + seconds
    pause = first
    while True:
        wait = pause * random.uniform(0.8, 1.2)
        if time.monotonic() + wait > deadline:
            return
        yield wait
        pause = min(most, pause * 2)
