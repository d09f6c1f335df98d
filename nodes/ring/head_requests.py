"""The head's requests by id and the gate a re-plan closes: shared by the head, its step scheduler and its watch
over the members, so none of them needs the others."""

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import torch

from nodes.errors import PrefixMissed, Rejected, RequestCancelled, RequestFailed
from nodes.ring.work import MAX_REQUESTS


class RingChanged(Exception):
    """The ring was re-planned while this request waited: replay it on the new ring."""


@dataclass
class HeadRequest:
    """The head's side of one request: the hidden state or failure the ring hands back."""

    waiter: asyncio.Future | None = None
    failure: RequestFailed | None = None
    rows: int = 0  # logit rows its step wants: 1 for a plain step (computed with the batch's), else its own
    logits: torch.Tensor | None = None  # [V] of the last step, when computed with its batch's

    def deliver(self, hidden: torch.Tensor) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(hidden)

    def fail(self, failure: RequestFailed) -> None:
        if failure.code == grpc.StatusCode.ABORTED:  # a node lacked the step's prefix or KV cache: the head retries
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(PrefixMissed(str(failure)))
            return
        self.failure = self.failure or failure
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(failure)

    def ring_changed(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(RingChanged())


class HeadRequests:
    """The requests the head serves now, and `ring_ready`, cleared while the ring is re-planned."""

    def __init__(self):
        self.by_id: dict[str, HeadRequest] = {}
        self.ended: RequestFailed | None = None  # this head gave its role up: a request that comes late ends so too
        self.ring_ready = asyncio.Event()
        self.ring_ready.set()

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

    def deliver(self, request_id: str, hidden: torch.Tensor) -> None:
        if (req := self.by_id.get(request_id)) is not None:
            req.deliver(hidden)

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
