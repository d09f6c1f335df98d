"""The node as its head sees it: exactly what the head (head.py), its step scheduler (steps.py) and its watch
over the members (members.py) use of the node that holds them, so the head's parts never import the node."""

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol

from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.text import TextCodec
from nodes.ring.config import NodeConfig, Stats
from nodes.ring.inbox import Inbox
from prima_rpc.spec.windows import Windows
from prima_rpc.v1 import prima_pb2 as pb


class NodePort(Protocol):
    cfg: NodeConfig  # token, draft, step_timeout
    address: str
    store: LayerStore | None  # the model's config, fingerprint, EOS ids
    shard: Shard | None  # embed, logits (None while re-planned)
    text: TextCodec | None
    pool: Executor  # the node's one compute thread: the head's torch work goes there too
    inbox: Inbox  # the head's steps enter the ring here
    outbox: asyncio.Queue[pb.Frame]  # RELEASE frames, and steps a head without layer 0 passes on
    stats: Stats  # last_token_ms
    epoch: int
    log: Any  # a structlog logger bound to the node
    last_error: str
    max_batch: int  # steps one batch takes at most
    micro_batches: int  # batches in the ring at once
    batching: tuple[int, int]  # (max_batch, micro_batches) as assigned: a re-plan keeps them
    fetching: bool  # an assignment is being fetched or loaded: the watch decides nothing meanwhile
    head: Any  # the Head this node holds, None once it gave way (members.py steps down on a split brain)
    head_address: str  # the head it follows
    windows: Windows | None  # None: it serves no frames

    def info(self) -> pb.NodeInfo:
        """What the node reports of itself (Control.Info)."""

    def release(self, request_id: str) -> None:
        """Free the request's KV cache here."""

    async def set_peer(self, peer: str) -> None:
        """Send frames to `peer` from now on."""

    async def assign(self, windows: Windows, model_id: str, progress: Callable[..., None], epoch: int = 0,
                     replan: bool = False, ring: list[str] = (), buffer_layers: float = 0.0, head_address: str = "",
                     max_batch: int = 0, micro_batches: int = 0,
                     predicted: tuple[float, float] = (0.0, 0.0), head_windows: tuple = (),
                     standby: bool = False) -> None:
        """Load `windows` (a re-plan: the head's own share of the new ring)."""
