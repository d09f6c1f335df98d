"""The head's requests by id and the gate a re-plan closes: shared by the head, its step scheduler and its watch
over the members, so none of them needs the others."""

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import torch

from nodes.errors import PrefixMissed, Rejected, RequestCancelled, RequestFailed
from nodes.ring.work import MAX_REQUESTS


class RingChanged(Exception):
    """The ring was re-planned while this request waited: replay it on the new ring."""


@dataclass
class Window:
    """One step of a request in the ring: its answer's future, and its logits when computed with its batch's."""

    waiter: asyncio.Future
    number: int = 0  # the request's step number (Frame.window), from 1
    rows: int = 0  # logit rows it wants: 1 for a plain step (computed with the batch's), else its own
    logits: torch.Tensor | None = None  # [V] of a plain step, when computed with its batch's


@dataclass
class HeadRequest:
    """The head's side of one request: the hidden states or failure the ring hands back. Its steps in the ring
    (several with speculative windows in flight, nodes/ring/inflight.py) come back in the order they went: every
    node computes a request's frames for the same layers in arrival order, over links that keep it."""

    windows: deque[Window] = field(default_factory=deque)
    failure: RequestFailed | None = None
    sent: int = 0  # steps numbered so far
    live_from: int = 0  # its steps numbered below this were cancelled (the nodes drop their frames)

    def expect(self, waiter: asyncio.Future, rows: int) -> Window:
        """A step goes into the ring: its answer is the next after those of the steps before it."""
        self.sent += 1
        self.windows.append(window := Window(waiter, self.sent, rows))
        return window

    def cancel_after(self, window: Window) -> None:
        """The steps sent after `window` are void: the nodes drop their frames from the next step on."""
        self.live_from = self.sent + 1

    @property
    def front(self) -> Window | None:
        """The step whose answer comes back next."""
        return self.windows[0] if self.windows else None

    def deliver(self, hidden: torch.Tensor, number: int = 0) -> int:
        """The answer of step `number` (0: the oldest): the cancelled steps before it were dropped on the way.
        Returns how many of its steps left the ring (those dropped and this one)."""
        left = 0
        while self.windows and number and self.windows[0].number < number:
            self.windows.popleft().waiter.cancel()
            left += 1
        if self.windows and (not number or self.windows[0].number == number):
            window = self.windows.popleft()
            left += 1
            if not window.waiter.done():  # a cancelled window's answer is dropped here
                window.waiter.set_result(hidden)
        return left

    def fail(self, failure: RequestFailed) -> None:
        if failure.code == grpc.StatusCode.ABORTED:  # a node lacked the step's prefix or KV cache: the head retries
            self._end(PrefixMissed(str(failure)))
            return
        self.failure = self.failure or failure
        self._end(failure)

    def ring_changed(self) -> None:
        self._end(RingChanged())

    def _end(self, exc: BaseException) -> None:
        """None of the answers of its steps in the ring will come: the one waited for (the oldest not cancelled)
        ends with `exc`, those after it are cancelled."""
        waiting = [w.waiter for w in self.windows if not w.waiter.done()]
        self.windows = deque()
        for i, waiter in enumerate(waiting):
            waiter.set_exception(exc) if i == 0 else waiter.cancel()

    def abandon(self) -> None:
        """Its steps in the ring are waited for no more (it failed, or its loop ended)."""
        windows, self.windows = self.windows, deque()
        for window in windows:
            window.waiter.cancel()


class HeadRequests:
    """The requests the head serves now, and `ring_ready`, cleared while the ring is re-planned."""

    def __init__(self):
        self.by_id: dict[str, HeadRequest] = {}
        self.ended: RequestFailed | None = None  # this head gave its role up: a request that comes late ends so too
        self.ring_ready = asyncio.Event()
        self.ring_ready.set()
        self.returned: Callable[[str], None] = lambda request_id: None  # a step of the request came back

    def __len__(self) -> int:
        return len(self.by_id)

    def known(self, request_id: str) -> bool:
        return request_id in self.by_id

    def get(self, request_id: str) -> HeadRequest | None:
        return self.by_id.get(request_id)

    def check_new(self, request_id: str) -> None:
        """Rejected when the head serves its most requests already, or the id is in use."""
        if len(self.by_id) >= MAX_REQUESTS:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the head serves at most {MAX_REQUESTS} requests")
        if request_id in self.by_id:
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is in use")

    def add(self, request_id: str) -> HeadRequest:
        req = self.by_id[request_id] = HeadRequest(failure=self.ended)
        return req

    def remove(self, request_id: str) -> None:
        del self.by_id[request_id]

    def deliver(self, request_id: str, hidden: torch.Tensor, number: int = 0) -> None:
        if (req := self.by_id.get(request_id)) is not None:
            for _ in range(req.deliver(hidden, number)):
                self.returned(request_id)

    def fail(self, request_id: str, failure: RequestFailed) -> None:
        if (req := self.by_id.get(request_id)) is not None:
            req.fail(failure)

    def fail_all(self, failure: RequestFailed) -> None:
        for req in self.by_id.values():
            req.fail(failure)

    def end(self, failure: RequestFailed) -> None:
        """This head is no longer the ring's: every request, also one under way into it, ends with `failure`."""
        self.ended = self.ended or failure
        self.fail_all(self.ended)

    def cancel(self, request_id: str) -> bool:
        if request_id not in self.by_id:
            return False
        self.fail(request_id, RequestCancelled())
        return True

    @contextmanager
    def replanning(self) -> Iterator[None]:
        """While the ring is re-planned: new steps wait, and steps in the old ring replay (RingChanged)."""
        self.ring_ready.clear()
        for req in self.by_id.values():
            req.ring_changed()
        try:
            yield
        finally:
            self.ring_ready.set()
