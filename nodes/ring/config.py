"""A node's settings, parsed once by prima-node's main(), and the running totals its status reports."""

from dataclasses import dataclass
from pathlib import Path

from nodes.ring.compute_pool import INLINE_S
from nodes.ring.work import MAX_BATCH


@dataclass(frozen=True)
class NodeConfig:
    port: int = 0
    host: str = "0.0.0.0"
    peer: str = ""
    model: Path | None = None
    cache: Path | None = None  # where weights fetched from other nodes go (None: never fetch)
    name: str = ""
    mem_budget: int = 0
    token: str | None = None
    dtype: str | None = None  # compute dtype; None: by the store and machine (nodes/engine/dtype_choice.py)
    kv_dtype: str = "auto"  # how KV caches store rows (nodes/engine/kv_dtype.py); auto: the plan's, else float
    ctx: int = 0  # KV positions the budget keeps room for, all requests together (0: the plan's, else the model's
    # own context under the default budget, KV_RESERVE_TOKENS under --mem-budget)
    step_timeout: float = 60.0  # head: longest wait for one ring round trip
    draft: Path | None = None  # a draft model store the head runs for speculate=draft
    max_batch: int = MAX_BATCH  # frames one compute takes at most (an assignment may set another)
    inline_s: float = INLINE_S  # compute jobs measured shorter run on the event loop (nodes/ring/compute_pool.py)
    prefix_dir: Path | None = None  # where cached prefixes are copied (nodes/engine/prefix_disk.py; None: nowhere)
    prefix_disk: int = 0  # bytes those copies may take (0: none are written)
    replan: bool = True  # head: re-plan the ring live when a device drifts from the plan (nodes/ring/replanner.py)
    max_cpu: float = 1.0  # the share of the device's cores it may use (nodes/ring/owner.py)
    max_memory: int = 0  # bytes it may use (0: no cap beyond mem_budget)
    nice: bool = False  # it runs at the lowest priority


@dataclass
class Stats:
    compute_s: float = 0.0  # wall time of frames in the compute thread, waits for streamed layers included
    stall_s: float = 0.0  # waits for streamed layers, of shards already replaced (the current one counts its own)
    link_s: float = 0.0
    frames: int = 0
    last_token_ms: float = 0.0
    decode_s: float = 0.0  # of compute_s, frames of one token since the assignment: status's per-token figure
    decode_frames: int = 0
    batches: int = 0  # computes run; frames computed in them below (mean batch = batched_frames / batches)
    batched_frames: int = 0
    max_batch_seen: int = 0
    queue_wait_s: float = 0.0  # frames' time in the inbox before their compute
    prefilled_tokens: int = 0  # prompt positions computed here
    prefix_hit_tokens: int = 0  # prompt positions copied from the prefix cache instead
    prefix_disk_tokens: int = 0  # prefix positions read from disk by shards replaced (the current one: its own)
