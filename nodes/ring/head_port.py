"""The node as its head sees it: exactly what the head (head.py), its step scheduler (steps.py) and its watch
over the members (members.py) use of the node that holds them, so the head's parts never import the node. The
node's role is not here: the head reads the windows it runs, and gives way only through `step_down`."""

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol

from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.text import TextCodec
from nodes.ring.assignment import Assignment, Place
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
    log: Any  # a structlog logger bound to the node
    last_error: str  # why the last re-plan failed

    # Read only: the node's assignment sets them.
    @property
    def epoch(self) -> int: ...
    @property
    def windows(self) -> Windows | None: ...  # the head's own: where its steps enter and leave the ring
    @property
    def fetching(self) -> bool: ...  # an assignment is being fetched or loaded: the watch decides nothing meanwhile
    @property
    def max_batch(self) -> int: ...  # steps one batch takes at most
    @property
    def micro_batches(self) -> int: ...  # batches in the ring at once
    @property
    def batching(self) -> tuple[int, int]: ...  # (max_batch, micro_batches) as assigned: a re-plan keeps them

    def info(self) -> pb.NodeInfo:
        """What the node reports of itself (Control.Info)."""

    def release(self, request_id: str) -> None:
        """Free the request's KV cache here."""

    async def set_peer(self, peer: str) -> None:
        """Send frames to `peer` from now on."""

    async def assign(self, job: Assignment, place: Place, progress: Callable[..., None]) -> None:
        """Load `job` (a re-plan: the head's own share of the new ring)."""

    async def step_down(self, head: str, why: str) -> None:
        """Give the head role to `head`: this head's requests end with `why`, and it closes."""
