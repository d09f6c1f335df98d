"""The compute loop's decisions that need no node: which waiting frames join a batch, what a batch adds to the
node's stats, and the status a request fails with when its frame cannot be computed."""

import time

import grpc

from nodes.errors import Rejected
from nodes.ring.config import Stats
from nodes.ring.inbox import Inbox
from nodes.ring.work import BATCH_WAIT_S, Work
from prima_rpc.v1 import prima_pb2 as pb

Code = grpc.StatusCode


async def gather(inbox: Inbox, first: Work, max_batch: int) -> list[Work]:
    """`first` and the frames of other requests waiting for the same layers of the same ring, up to
    `max_batch`, in arrival order. Frames that cannot join stay queued in their order. When the last frame
    taken says more of its batch follow (batch_rest), wait for them briefly (BATCH_WAIT_S), but not once a
    frame that cannot join is waiting (it must not be held back)."""
    batch, ids = [first], {first.request_id}

    def joins(w: Work) -> bool:  # one frame a request: its windows in flight compute one after another, in order
        if (w.kind == pb.FORWARD and w.next_layer == first.next_layer and w.epoch == first.epoch
                and w.request_id not in ids):
            ids.add(w.request_id)
            return True
        return False

    deadline = time.perf_counter() + BATCH_WAIT_S
    while len(batch) < max_batch:
        taken = inbox.take(joins, max_batch - len(batch))
        batch += taken
        left = deadline - time.perf_counter()
        if batch[-1].batch_rest == 0 or len(batch) >= max_batch or not inbox.empty() or left <= 0:
            break
        if not await inbox.arrival(left):
            break
    return batch


def count_batch(s: Stats, computed: list[Work], start: float, took: float, first_pass: bool = True) -> None:
    """Add a compute of `computed` (their frames as they were queued) that began at `start` and took `took` s;
    first_pass: at the node's first window (prompt positions are counted once per node)."""
    s.compute_s += took
    if first_pass:
        s.prefilled_tokens += sum(w.hidden.shape[0] for w in computed if w.prefix.prefill)
        s.prefix_hit_tokens += sum(w.prefix.length for w in computed if w.prefix.key and w.start_pos == w.prefix.length)
    s.frames += len(computed)
    if all(w.hidden.shape[0] == 1 for w in computed):  # a decode step: what a token waits for here
        s.decode_s += took
        s.decode_frames += 1
    s.batches += 1
    s.batched_frames += len(computed)
    s.max_batch_seen = max(s.max_batch_seen, len(computed))
    s.queue_wait_s += sum(start - w.queued for w in computed)


def failure(exc: Exception) -> tuple[Code, str]:
    """The status a request fails with when its frame cannot be computed."""
    if isinstance(exc, Rejected):
        return exc.code, str(exc)
    if isinstance(exc, ValueError):  # positions or capacity that do not fit this request's KV cache
        return Code.INVALID_ARGUMENT, str(exc)
    return Code.INTERNAL, f"{type(exc).__name__}: {exc}"
