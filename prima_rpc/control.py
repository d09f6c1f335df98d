"""A handle on one node's Control service: its channel, the token's metadata and a deadline on every call.

`Control` serves code without an event loop (prima-ctl), `AioControl` the nodes and the HTTP API. The calls are
written once for both: a sync stub returns the reply (Assign: an iterator of LoadProgress), an aio stub an
awaitable of it (Assign: an async iterator).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

from prima_rpc.channel import aio_channel, metadata, sync_channel
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc


@dataclass(frozen=True)
class Deadlines:
    """Seconds each call may take before it fails with DEADLINE_EXCEEDED."""

    info: float = 5.0  # a node answers from memory
    set_peer: float = 5.0
    shutdown: float = 5.0
    profile: float = 120.0  # a fresh profile measures compute, memory and disk
    assign: float = 3600.0  # a first start may fetch GBs of weights over a home link before loading them
    leave: float = 600.0  # the head re-plans without the member: its survivors may load (and fetch) layers
    draft: float = 30.0  # a member's draft model drafts a few tokens (its first ask loads it)


def assign_request(ranges: Iterable[tuple[int, int]], n_layers: int, model_id: str, epoch: int, *,
                   head: bool = False, replan: bool = False, ring: Sequence[str] = (), head_address: str = "",
                   buffer_layers: float = 0.0, predicted_ms: float = 0.0, predicted_tpot_ms: float = 0.0,
                   max_batch: int = 0, micro_batches: int = 0, head_windows: Iterable[tuple[int, int]] = (),
                   standby: bool = False, kv_dtype: str = "", ctx: int = 0) -> pb.AssignRequest:
    """Hold `ranges` ([start, stop) of the model's `n_layers`; none: a relay) under the ring's `epoch`.

    ring: every member in ring order, the head's address first; the plan's buffer_layers, predictions and
    batching (0: the node's defaults); (members) the head's windows and whether to keep a standby copy of its units;
    the plan's KV dtype for the node and context of the ring ("", 0: the node's own)."""
    return pb.AssignRequest(windows=[pb.LayerRange(start=a, stop=b) for a, b in ranges], head=head,
                            model_id=model_id, ring_layers=n_layers, epoch=epoch, replan=replan, ring=list(ring),
                            head_address=head_address, stream_buffer_layers=buffer_layers,
                            predicted_ms=predicted_ms, predicted_tpot_ms=predicted_tpot_ms, max_batch=max_batch,
                            micro_batches=micro_batches, kv_dtype=kv_dtype, ctx=ctx,
                            head_windows=[pb.LayerRange(start=a, stop=b) for a, b in head_windows], standby=standby)


class _Peer:
    """The calls, for a sync or an aio channel alike."""

    def __init__(self, address: str, channel: grpc.Channel | grpc.aio.Channel, token: str | None,
                 deadlines: Deadlines):
        self.address, self.deadlines = address, deadlines
        self._channel = channel
        self._stub = rpc.ControlStub(channel)
        self._metadata = metadata(token)

    def info(self):
        """The node's NodeInfo."""
        return self._stub.Info(pb.InfoRequest(), metadata=self._metadata, timeout=self.deadlines.info)

    def assign(self, request: pb.AssignRequest):
        """LoadProgress updates until the node holds its windows (one with ready set last)."""
        return self._stub.Assign(request, metadata=self._metadata, timeout=self.deadlines.assign)

    def set_peer(self, peer: str, drain: bool = False):
        """Send frames to `peer` (HOST:PORT) from now on; drain: the frames already sent reach the old one first."""
        return self._stub.SetPeer(pb.SetPeerRequest(peer=peer, drain=drain), metadata=self._metadata,
                                  timeout=self.deadlines.set_peer)

    def profile(self, refresh: bool = False):
        """The node's device profile (JSON) and its model's manifest; refresh: measure again."""
        return self._stub.Profile(pb.ProfileRequest(refresh=refresh), metadata=self._metadata,
                                  timeout=self.deadlines.profile)

    def fetch(self, model_id: str, name: str):
        """The chunks (FileChunk) of a file of the node's store: "manifest", "tokenizer" or a unit's name."""
        return self._stub.Fetch(pb.FetchRequest(model_id=model_id, name=name), metadata=self._metadata,
                                timeout=self.deadlines.info)

    def leave(self, address: str):
        """(The head) take member `address` out of the ring: re-plan without it, then stop it."""
        return self._stub.Leave(pb.LeaveRequest(address=address), metadata=self._metadata,
                                timeout=self.deadlines.leave)

    def join(self, address: str, model_id: str = ""):
        """(The head) insert the node at `address` into the ring, before the head."""
        return self._stub.Join(pb.JoinRequest(address=address, model_id=model_id), metadata=self._metadata,
                               timeout=self.deadlines.leave)

    def take_over(self, lost: str, ring: Sequence[str], forget: bool = False):
        """(The standby) become the ring's head in place of `lost`, which hands over."""
        return self._stub.TakeOver(pb.TakeOverRequest(lost=lost, ring=list(ring), forget=forget),
                                   metadata=self._metadata, timeout=self.deadlines.leave)

    def draft(self, request: pb.DraftRequest):
        """(A member with --draft) its draft model's continuation of a request's context."""
        return self._stub.Draft(request, metadata=self._metadata, timeout=self.deadlines.draft)

    def shutdown(self):
        return self._stub.Shutdown(pb.ShutdownRequest(), metadata=self._metadata, timeout=self.deadlines.shutdown)


class Control(_Peer):
    """A node's Control service on a channel of its own; `with` closes it."""

    def __init__(self, address: str, token: str | None = None, deadlines: Deadlines = Deadlines()):
        super().__init__(address, sync_channel(address), token, deadlines)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Control":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AioControl(_Peer):
    """The same on an aio channel: await each call; made on the event loop that uses it."""

    def __init__(self, address: str, token: str | None = None, deadlines: Deadlines = Deadlines()):
        super().__init__(address, aio_channel(address), token, deadlines)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AioControl":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
