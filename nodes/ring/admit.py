"""What a node checks of a frame from its predecessor before it queues it: Rejected says why not."""

import grpc
import torch

from nodes.engine.prefix_cache import Prefix
from nodes.errors import Rejected
from nodes.ring.work import MAX_ID, MAX_REQUESTS, Work
from prima_rpc import codec
from prima_rpc.channel import MAX_MESSAGE_BYTES
from prima_rpc.spec.windows import Windows
from prima_rpc.v1 import prima_pb2 as pb

Code = grpc.StatusCode


def check_structure(frame: pb.Frame) -> None:
    """What any node can judge of a frame, assigned or not."""
    if frame.kind not in (pb.FORWARD, pb.RELEASE, pb.ERROR):
        raise Rejected(Code.INVALID_ARGUMENT, f"unknown frame kind {frame.kind}")
    if not (0 < len(frame.request_id) <= MAX_ID):
        raise Rejected(Code.INVALID_ARGUMENT, f"request_id must have 1..{MAX_ID} characters")
    if frame.batch_rest >= MAX_REQUESTS or (frame.batch_rest and frame.kind != pb.FORWARD):
        raise Rejected(Code.INVALID_ARGUMENT, f"batch_rest {frame.batch_rest} must be below {MAX_REQUESTS}, "
                                              "and 0 except on FORWARD frames")
    if len(frame.prefix_key) > MAX_ID or len(frame.save_key) > MAX_ID:
        raise Rejected(Code.INVALID_ARGUMENT, f"prefix keys must have at most {MAX_ID} characters")
    if (frame.prefix_key and not frame.prefix_len) or (frame.save_key and not frame.save_len):
        raise Rejected(Code.INVALID_ARGUMENT, "a prefix key needs a length of at least one position")
    if frame.prefix_key and frame.start_pos != frame.prefix_len:
        raise Rejected(Code.INVALID_ARGUMENT, f"a frame from prefix {frame.prefix_key[:12]} of {frame.prefix_len} "
                                              f"positions must start there, not at {frame.start_pos}")


def checked_hidden(frame: pb.Frame, hidden_size: int) -> torch.Tensor:
    """A FORWARD frame's hidden state [tokens >= 1, hidden_size], decoded."""
    try:
        hidden = codec.decode(frame.hidden, max_bytes=MAX_MESSAGE_BYTES)
    except codec.CodecError as exc:
        raise Rejected(Code.INVALID_ARGUMENT, f"hidden: {exc}") from None
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size or hidden.shape[0] == 0:
        raise Rejected(Code.INVALID_ARGUMENT,
                       f"hidden must be [tokens >= 1, {hidden_size}], got {list(hidden.shape)}")
    return hidden


def check_in_ring(frame: pb.Frame, hidden: torch.Tensor, windows: Windows, max_seq_len: int, known: bool) -> None:
    """What only the current ring can judge of a FORWARD frame: its next layer, its positions, and (past the
    first chunk) that its request is known here (known: it has a KV cache here, or this head serves it)."""
    why = windows.check_received(frame.next_layer)
    if why:
        raise Rejected(Code.INVALID_ARGUMENT, why)
    if frame.start_pos + hidden.shape[0] > max_seq_len:
        raise Rejected(Code.OUT_OF_RANGE, f"positions up to {frame.start_pos + hidden.shape[0]} exceed the "
                                       f"context {max_seq_len}")
    if frame.start_pos > 0 and not known and not frame.prefix_key:
        raise Rejected(Code.NOT_FOUND, f"unknown request id {frame.request_id!r}")


def forward_work(frame: pb.Frame, hidden: torch.Tensor) -> Work:
    """A checked FORWARD frame as the compute loop takes it."""
    prefix = Prefix(frame.prefix_key, frame.prefix_len, frame.save_key, frame.save_len, frame.prefill)
    return Work(frame.request_id, pb.FORWARD, frame.start_pos, frame.next_layer, frame.capacity, hidden,
                epoch=frame.epoch, batch_rest=frame.batch_rest, prefix=prefix, window=frame.window,
                live_from=frame.live_from)


class KvLedger:
    """The head's account of the ring's KV positions, so that a request that cannot fit is refused before it
    starts: each node's room (asked once an epoch) and the positions its requests hold. Every request holds a
    cache of the same capacity on every node, so the node with the least room decides."""

    def __init__(self):
        self.epoch: int | None = None  # that of `rooms`
        self.rooms: dict[str, int] = {}  # address -> KV positions its budget holds (0: no limit)
        self.held: dict[str, int] = {}  # request id -> its capacity

    def admit(self, request_id: str, prompt: int, capacity: int) -> None:
        """Hold `capacity` positions for the request, or Rejected with the numbers: INVALID_ARGUMENT if the ring
        cannot hold it even alone, RESOURCE_EXHAUSTED if only its other requests are in the way."""
        limited = {a: r for a, r in self.rooms.items() if r}
        if limited:
            where, room = min(limited.items(), key=lambda item: item[1])
            used = sum(self.held.values())
            need = (f"the request needs {capacity} KV positions (a prompt of {prompt} tokens + max_tokens "
                    f"{capacity - prompt})")
            if capacity > room:
                raise Rejected(Code.INVALID_ARGUMENT, f"{need}; the memory budget of node {where} leaves room for "
                                                      f"{room} KV positions in all: lower max_tokens, shorten the "
                                                      "prompt, or raise --mem-budget there")
            if capacity > room - used:
                raise Rejected(Code.RESOURCE_EXHAUSTED, f"{need}; node {where} has {room - used} KV positions free "
                                                        f"of {room} ({len(self.held)} other requests hold the rest):"
                                                        " wait for them or lower max_tokens")
        self.held[request_id] = capacity

    def free(self) -> int | None:
        """Positions the tightest node has free beside the requests held, for cached prefixes (None: no limit)."""
        limited = [r for r in self.rooms.values() if r]
        return min(limited) - sum(self.held.values()) if limited else None

    def release(self, request_id: str) -> None:
        self.held.pop(request_id, None)
