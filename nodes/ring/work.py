"""What flows through a node's queues, and the limits that keep the ring from deadlocking."""

import time
from dataclasses import dataclass, field

import grpc
import torch

from nodes.engine.prefix_cache import NONE, Prefix

MAX_REQUESTS = 64
MAX_CACHES = 2 * MAX_REQUESTS  # KV caches per node (a worker cannot tell live requests from abandoned ones)
CACHE_IDLE_S = 120.0  # a cache untouched this long lost its RELEASE frame
QUEUE = 4 * MAX_REQUESTS
PREFILL_CHUNK = 256  # prompt tokens per ring frame
MAX_BATCH = 32  # frames one compute takes by default (prima-node --max-batch): per-row cost still fell at 32 here
BATCH_WAIT_S = 0.02  # longest wait for the rest of a batch announced by batch_rest
MAX_ID = 128


@dataclass
class Work:
    request_id: str
    kind: int
    start_pos: int = 0
    next_layer: int = 0
    capacity: int = 0
    hidden: torch.Tensor | None = None
    error: str = ""
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN  # ERROR: the status the head ends the request with
    epoch: int = 0
    batch_rest: int = 0  # FORWARD: this many more frames of the same batch follow (they compute together)
    prefix: Prefix = NONE  # FORWARD: what it asks of the prefix cache (nodes/engine/prefix_cache.py)
    queued: float = field(default_factory=time.perf_counter)  # when it entered the inbox
    window: int = 0  # FORWARD: the head's number of this step (0: unnumbered)
    live_from: int = 0  # FORWARD: the request's steps numbered below this were cancelled (inbox.Inbox drops them)
