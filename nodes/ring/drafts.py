"""Drafting on any device: a node started with `--draft DIR` (the head itself, or a relay that holds no layers)
runs the draft model; a head without one asks such a member over Control.Draft for each window's drafts."""

from collections import OrderedDict
from pathlib import Path

import grpc

from nodes.errors import Rejected
from nodes.generation.draft import DraftModel, vocab_fingerprint
from nodes.generation.reference import ReferenceModel
from prima_rpc.control import AioControl
from prima_rpc.request import DRAFT_TOKENS
from prima_rpc.spec.manifest import StoreError
from prima_rpc.v1 import prima_pb2 as pb

KEPT = 16  # requests whose draft KV caches a member keeps (the least recently asked goes first)


class DraftServer:
    """A member's draft model (loaded at the first ask) and its requests' draft caches."""

    def __init__(self, store: Path):
        self.store = store
        self.model: ReferenceModel | None = None
        self.vocab = ""
        self.requests: OrderedDict[str, DraftModel] = OrderedDict()

    def draft(self, request: pb.DraftRequest) -> list[int]:
        """The draft model's continuation of request.context (on the compute thread); Rejected for what does
        not fit: another tokenizer (FAILED_PRECONDITION), ids or lengths out of range (INVALID_ARGUMENT)."""
        if self.model is None:
            try:
                model = ReferenceModel(self.store)
            except StoreError as exc:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"the draft model {self.store}: {exc}") from None
            self.model, self.vocab = model, vocab_fingerprint(model.codec)
        cfg = self.model.cfg
        if request.vocab != self.vocab:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                           f"the draft model {self.model.codec.manifest.name} ({self.store}) does not share the "
                           "target's tokenizer")
        if not DRAFT_TOKENS[0] <= request.n <= DRAFT_TOKENS[1] or not 0 < len(request.context) < cfg.max_seq_len \
                or len(request.request_id) > 128 or not all(0 <= t < cfg.vocab for t in request.context):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"a draft asks for n in {list(DRAFT_TOKENS)} after 1 to {cfg.max_seq_len - 1} ids in "
                           f"[0, {cfg.vocab}), with a request id of at most 128 characters")
        drafter = self.requests.pop(request.request_id, None) or DraftModel(self.model)
        self.requests[request.request_id] = drafter
        while len(self.requests) > KEPT:
            self.requests.popitem(last=False)
        return drafter.draft(list(request.context), request.n)


class RemoteDrafter:
    """The head's drafter for one request when a member drafts: Speculator asks it through `draft_async`."""

    remote = True

    def __init__(self, control: AioControl, request_id: str, vocab: str):
        self.control, self.request_id, self.vocab = control, request_id, vocab

    async def draft_async(self, context: list[int], n: int) -> list[int]:
        try:
            reply = await self.control.draft(pb.DraftRequest(request_id=self.request_id, context=context, n=n,
                                                             vocab=self.vocab))
        except grpc.aio.AioRpcError as exc:  # another tokenizer: FAILED_PRECONDITION; else the member is unwell
            code = exc.code() if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else grpc.StatusCode.UNAVAILABLE
            raise Rejected(code, f"drafting on {self.control.address} failed: {exc.details()}") from None
        return list(reply.tokens)[:n]
