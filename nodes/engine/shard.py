"""The model part a node holds for one assignment: its windows' layers, KV caches, and (head) the head.

Under a memory budget only some layers (down to single matrices) stay resident; the rest stream from the
layer store through a `Prefetcher`'s buffer (nodes/engine/prefetch.py), stage by stage (nodes.engine.model.STAGES).
Everything here is synchronous torch work, called from the node's single compute thread (the prefetcher
reads on its own thread). The budget's maths are nodes/engine/budget.py, the reads that load a shard
nodes/engine/loading.py.
"""

import time
from collections.abc import Callable

import structlog
import torch

from nodes.engine import window_calls
from nodes.engine.budget import shard_budget
from nodes.engine.expert_cache import ExpertCache
from nodes.engine.formats import weight_format
from nodes.engine.fused import STREAM_UNITS, kv_bytes
from nodes.engine.kv_dtype import FLOAT, KVDtype
from nodes.engine.loading import ReportingStore, load_head, load_layers, shard_units
from nodes.engine.memory_plan import MemoryPlan
from nodes.engine.model import (
    STAGES,
    KVCache,
    OutputHead,
    Rope,
    Segment,
    attention_stage,
    down_stage,
    gate_up_stage,
    layer_forward,
    nbytes,
)
from nodes.engine.prefetch import Prefetcher, default_budget, prefetch_depth
from nodes.engine.prefix_cache import BLOCK, NONE, Prefix, PrefixCache
from nodes.engine.prefix_disk import PrefixDisk
from nodes.engine.store import LayerStore
from nodes.errors import KvMissing, PrefixMissed
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.windows import Windows


class Shard:
    def __init__(self, store: LayerStore, windows: Windows, dtype: torch.dtype,
                 progress: Callable[[int, int, str], None] = lambda done, total, unit: None,
                 *, budget: int | None = 0, depth: int | None = None, buffer: int = 0, log=None,
                 kv_dtype: KVDtype = FLOAT, ctx: int = 0, disk: PrefixDisk | None = None):
        """budget: bytes for weights and the KV reserve (0: unlimited, None: from the available RAM);
        depth: 0 loads streamed layers on demand (None: DEPTH or $PRIMA_PREFETCH_DEPTH);
        buffer: stream buffer bytes, the plan's choice (0: DEPTH + 1 layers);
        kv_dtype: how KV caches store their rows; ctx: the KV positions the budget reserves room for (0: the
        default, nodes.engine.prefetch.kv_reserve_tokens);
        disk: where cached prefixes are also written, and read back when not in memory (None: nowhere)."""
        default = budget is None  # its KV reserve: a request at the whole context
        budget = default_budget() if default else budget
        depth = prefetch_depth() if depth is None else depth
        self.store, self.windows, self.dtype, self.kv_dtype, self.ctx = store, windows, dtype, kv_dtype, ctx
        self.cfg = cfg = store.config
        self.fmt = fmt = weight_format(store.manifest)  # None: float matrices
        self.log = log or structlog.get_logger()
        head_fmt = weight_format(store.manifest, "embed") if windows.head else None
        planned = shard_budget(cfg, windows, dtype, fmt, head_fmt, budget, depth > 0, buffer, default, kv_dtype, ctx)
        self.plan: MemoryPlan = planned.plan
        self.kv_room = planned.kv_room  # None: no budget
        reporting = ReportingStore(store, shard_units(windows, cfg.n_experts), progress)
        self.head: OutputHead | None = load_head(reporting, cfg, dtype, fmt) if windows.head else None
        self.prefetcher = Prefetcher(store, self.plan, cfg, dtype, fmt) if self.plan.streamed else None
        cached = planned.expert_room is not None  # a mixture whose experts do not all fit: cache them
        self.layers, self.small, self.kept = load_layers(reporting, self.plan, cfg, dtype, fmt, self.prefetcher,
                                                         [] if cached else None)
        self.experts = ExpertCache(store, cfg, dtype, fmt, planned.expert_room, self.plan.order) if cached else None
        for i, layer in self.layers.items() if cached else ():
            layer.moe.experts = self.experts.source(i)
        if self.prefetcher:
            self.prefetcher.start()
        self.rope = Rope(cfg, cfg.max_seq_len, dtype)
        self.caches: dict[str, KVCache] = {}
        self._runs: dict[tuple[int, int], list[tuple[int, int]]] = {}  # _resident_runs' cuts of a window
        self.prefixes = PrefixCache()  # KV of recent prompt prefixes, inside the KV room (dropped with the shard)
        self.disk = disk  # and their copies on disk, which outlive it
        self.disk_loaded = 0  # prefix positions read from the disk
        self.last_stop = max((stop for _, stop in windows.ranges), default=0)  # a frame's last layer here
        self.compute_s = 0.0  # in compute(), stalls excluded
        self._stalled = 0.0
        if self.plan.streamed:
            self._log_plan()

    def _log_plan(self) -> None:
        """Which layers stream and how (a warning when the budget was below the plan's minimum)."""
        p = self.plan
        (self.log.warning if p.below_minimum else self.log.info)(
            "offload plan", budget=p.budget, requested_budget=p.requested, resident=sorted(p.resident),
            streamed=[f"{layer}" + ("" if len(us) == len(STREAM_UNITS) else f"({','.join(us)})")
                      for layer, us in p.streamed],
            buffer=p.buffer, streamed_bytes=p.streamed_bytes, prefetch=p.prefetch, layer_bytes=p.layer_bytes,
            read=self.store.read_method)

    @property
    def stall_s(self) -> float:
        """Waits for streamed layers, as of the last finished compute() (so that compute time measured around
        a frame, minus this, never goes back while a frame is in progress)."""
        return self._stalled

    def resident_bytes(self) -> int:
        """Weights held in memory (resident layers and matrices, stream buffer, head) plus the KV caches."""
        weights = sum(layer.nbytes() for layer in self.layers.values())
        weights += sum(nbytes(t) for parts in (*self.small.values(), *self.kept.values())
                       for t in parts.values() if t is not None)
        if self.prefetcher:
            weights += self.prefetcher.buffer.numel()
        if self.experts is not None:
            weights += self.experts.held_bytes
        if self.head is not None:
            weights += sum(nbytes(t) for t in {id(t): t for t in
                           (self.head.embed, self.head.norm, self.head.output)}.values())
        return weights + sum(c.nbytes() for c in self.caches.values()) + self.prefixes.nbytes()

    def close(self) -> None:
        """Stop the prefetcher's, the expert reader's and the prefix writer's threads (the shard is being replaced)."""
        if self.prefetcher:
            self.prefetcher.close()
        if self.experts is not None:
            self.experts.close()
        if self.disk is not None:
            self.disk.close()  # its writes finish first

    def cache_for(self, request_id: str, start_pos: int, capacity: int, tokens: int,
                  prefix: Prefix = NONE) -> KVCache:
        """The request's cache, made on its first frame (from a cached prefix when the frame names one: PrefixMissed
        if it is not here); ValueError for frames that do not fit it."""
        cache = self.caches.get(request_id)
        if cache is None:
            first = prefix.length if prefix.key else 0
            if start_pos != first:
                raise KvMissing(f"no KV cache here for request {request_id!r} at position {start_pos} (frames of a "
                                "new request start at 0); the head replays it")
            if not (start_pos + tokens <= capacity <= self.cfg.max_seq_len):
                raise ValueError(f"capacity {capacity} must be in [{start_pos + tokens}, {self.cfg.max_seq_len}]")
            if prefix.key and not self.prefixes.holds(prefix.key, prefix.length):
                self._load_prefix(prefix.key, prefix.length)
            self._check_kv_room(capacity)
            cache = KVCache(self.windows.layers(), self.cfg, capacity, self.dtype, self.kv_dtype)
            if prefix.key:
                self.prefixes.take(prefix.key, prefix.length, cache, request_id)
            elif prefix.prefill and tokens >= BLOCK:
                self.prefixes.on_pages(cache)  # it may save a prefix, then hold it once (adopt)
            self.caches[request_id] = cache
        if start_pos + tokens > cache.capacity:
            raise ValueError(f"positions [{start_pos}, {start_pos + tokens}) exceed the request's "
                             f"KV capacity {cache.capacity}")
        if prefix.save_key and prefix.save_len <= cache.capacity:
            cache.prefix_save = (prefix.save_key, prefix.save_len)
        return cache

    def _check_kv_room(self, capacity: int) -> None:
        """A new cache must fit the memory budget beside the caches already held: cached prefixes are dropped
        (least recently used first) to make room, and only then is the request refused, clearly, not overrun."""
        if self.kv_room is None:
            return
        while not self._fits(capacity) and self.prefixes.evict_one():
            pass
        if not self._fits(capacity):
            room = min(self._positions_in(self._free()), self.cfg.max_seq_len)
            raise ValueError(f"the memory budget ({self.plan.budget >> 20} MiB) leaves room for {room} more KV "
                             f"positions on this node, the request needs {capacity} (prompt + max_tokens): "
                             "lower max_tokens, wait for other requests, or raise --mem-budget")

    def _cache_bytes(self, positions: int) -> int:
        """What a new request's cache of `positions` takes here (sliding-window layers: their ring)."""
        return kv_bytes(self.cfg, self.dtype, self.windows.layers(), positions, self.kv_dtype)

    def _free(self) -> int:
        return self.kv_room - sum(c.nbytes() for c in self.caches.values()) - self.prefixes.nbytes()

    def _fits(self, positions: int) -> bool:
        return self.kv_room is None or self._cache_bytes(positions) <= self._free()

    def _positions_in(self, room: int) -> int:
        """The most positions a request's cache may have in `room` bytes (sliding-window layers: their ring)."""
        # _cache_bytes grows with positions
        lo, hi = 0, max(room, 0) // kv_bytes(self.cfg, self.dtype, 1, 1, self.kv_dtype)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._cache_bytes(mid) <= room else (lo, mid - 1)
        return lo

    def _save_prefixes(self, items: list[tuple[torch.Tensor, KVCache, int]]) -> None:
        """Keep the prefixes the frames asked for once their positions went through this node's last window (older
        prefixes make room; a prefix that does not fit even alone is not kept: a later request misses it)."""
        for h, cache, pos in items:
            if cache.prefix_save is None or pos + h.shape[0] < cache.prefix_save[1]:
                continue
            (key, length), cache.prefix_save = cache.prefix_save, None
            if not cache.reusable_prefix(pos + h.shape[0]):
                continue  # a sliding-window layer's ring wrapped: the prompt's start is gone
            if self._keep_room(length):
                self.prefixes.save(key, length, cache.kv)
                self.prefixes.adopt(key, cache, next(r for r, c in self.caches.items() if c is cache))
                self._write_prefix(key, length)

    def _keep_room(self, length: int) -> bool:
        """Room for a prefix of `length` positions, older prefixes evicted for it; False (none evicted) if it would
        not fit even alone."""
        if self.kv_room is not None and self._cache_bytes(length) > self._free() + self.prefixes.nbytes():
            return False
        while not self._fits(length) and self.prefixes.evict_one():
            pass
        return True

    def _write_prefix(self, key: str, length: int) -> None:
        """The cached prefix's copy on disk, a file per window (written on the disk's own thread)."""
        if self.disk is None:
            return
        entry = self.prefixes.rows(key)
        for start, stop in self.windows.ranges:
            self.disk.write((start, stop), key, length, {i: entry[i] for i in range(start, stop)})

    def _load_prefix(self, key: str, length: int) -> None:
        """A prefix missing from memory, read from this node's disk into the prefix cache; PrefixMissed if a window's
        file is missing, broken or too short (the head then prefills from 0)."""
        entry: dict[int, torch.Tensor] = {}
        for window in self.windows.ranges if self.disk is not None else ():
            got = self.disk.read(window, key)
            if got is None or got[0] < length:
                break
            entry.update(got[1])
        else:
            if self.disk is not None and self._keep_room(length):
                self.prefixes.put(key, entry)
                self.disk_loaded += length
                return
        raise PrefixMissed(f"prefix {key[:12]} of {length} positions is not cached on this node")

    def kv_bytes_per_token(self) -> int:
        """KV bytes one position of a request takes here, over this shard's layers."""
        return self.kv_dtype.bytes_per_token(self.cfg.n_kv_heads, self.cfg.head_dim, self.dtype,
                                             len(self.windows.layers()))

    def kv_positions(self) -> int:
        """The KV positions this shard's budget holds, all requests together (0: no budget, no limit): those of one
        request filling the KV room (sliding-window layers hold their ring only, so more than the room over every
        layer's bytes a position)."""
        if self.kv_room is None:
            return 0
        return max(self._positions_in(self.kv_room), 1)

    def release(self, request_id: str) -> bool:
        found = self.caches.pop(request_id, None) is not None
        self.prefixes.release(request_id)
        if found and self.prefetcher:
            p = self.prefetcher
            self.log.info("offload stats", request_id=request_id, resident_bytes=self.resident_bytes(),
                          disk_read_bytes=self.store.bytes_read, compute_s=round(self.compute_s, 3),
                          stall_s=round(p.stall_s, 3), loads=p.loads, misses=p.misses)
        return found

    def compute(self, x: torch.Tensor, cache: KVCache, start_pos: int, next_layer: int) -> tuple[torch.Tensor, int]:
        """One request: the batch of one."""
        (x,), next_layer = self.compute_batch([(x, cache, start_pos)], next_layer)
        return x, next_layer

    @torch.inference_mode()
    def compute_batch(self, items: list[tuple[torch.Tensor, KVCache, int]],
                      next_layer: int) -> tuple[list[torch.Tensor], int]:
        """Run every consecutive window from next_layer for several requests at once (one pass over the weights,
        one read of a streamed layer): items are (hidden [T, H], its KV cache, its start position). Returns each
        request's new hidden state and the next layer."""
        begin, stalled = time.perf_counter(), self._stalled
        x = torch.cat([h for h, _, _ in items]) if len(items) > 1 else items[0][0]
        x = x.to(self.dtype)
        lengths = [h.shape[0] for h, _, _ in items]
        spans = [(cache, pos, t) for (_, cache, pos), t in zip(items, lengths, strict=True)]
        for start, stop in self.windows.run_from(next_layer):
            for a, b in self._resident_runs(start, stop):
                y = window_calls.forward(x, self.layers, a, b, spans, self.cfg, self.rope) if a in self.layers else None
                x = y if y is not None else self._layers_forward(x, a, b, spans)
            next_layer = stop
        if next_layer == self.last_stop:
            self._save_prefixes(items)
        if self.prefetcher:
            self._stalled = self.prefetcher.stall_s
        self.compute_s += time.perf_counter() - begin - (self._stalled - stalled)
        return list(x.split(lengths)) if len(items) > 1 else [x], next_layer

    def _resident_runs(self, start: int, stop: int) -> list[tuple[int, int]]:
        """[start, stop) cut where a layer turns from resident to streamed or back (a decode step takes a resident
        run in one C call: window_calls)."""
        runs = self._runs.get((start, stop))
        if runs is None:
            cuts = [i for i in range(start + 1, stop) if (i in self.layers) != (i - 1 in self.layers)]
            self._runs[(start, stop)] = runs = list(zip([start, *cuts], [*cuts, stop], strict=True))
        return runs

    def _layers_forward(self, x: torch.Tensor, start: int, stop: int, spans: list) -> torch.Tensor:
        """Layers [start, stop) one by one: spans [(cache, pos, t)], one per request."""
        for i in range(start, stop):
            segs = [Segment(cache.kv[i], pos, t) for cache, pos, t in spans]
            layer = self.layers.get(i)
            if layer is not None:
                x = layer_forward(x, layer, segs, self.cfg, self.rope.layer(i))
            else:
                x = self._streamed_forward(i, x, segs)
        return x

    def _streamed_forward(self, i: int, x: torch.Tensor, segs: list[Segment]) -> torch.Tensor:
        """A streamed layer stage by stage: each stage waits only for its own matrices and frees them after."""
        small, kept, cfg = self.small[i], self.kept[i], self.cfg

        def run(stage: tuple[str, ...], fn):
            streamed = tuple(u for u in stage if u not in kept)
            try:
                got = self.prefetcher.acquire(i, streamed) if streamed else {}
            except StoreError as exc:  # the node fails the request (ValueError) rather than the whole loop
                raise ValueError(f"layer {i} could not be read: {exc}") from None
            try:
                return fn(**{u: got[u] if u in got else kept[u] for u in stage})
            finally:
                if streamed:
                    self.prefetcher.release(i, streamed)

        attn, gate_up, down = STAGES
        rope = self.rope.layer(i)
        h = run(attn, lambda wqkv, wo: attention_stage(x, small, wqkv, wo, segs, cfg, rope))
        a = run(gate_up, lambda w_gate_up: gate_up_stage(h, small["ffn_norm"], w_gate_up, cfg))
        return run(down, lambda w_down: down_stage(h, a, w_down, small["post_ffn_norm"], cfg.norm_eps))

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.head.embed_tokens(torch.tensor(ids))

    @torch.inference_mode()
    def last_logits(self, hs: list[torch.Tensor]) -> torch.Tensor:
        """Float32 logits [n, V] of the last position of each of n hidden states, in one projection."""
        return self.head.logits(torch.cat([h[-1:] for h in hs]).to(self.dtype), self.cfg.norm_eps)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [V] of the last position of h [T, H]."""
        return self.head.logits(h[-1:].to(self.dtype), self.cfg.norm_eps)[0]


def check_assignment(store: LayerStore | None, windows: Windows, model_id: str) -> None:
    if store is not None and model_id and model_id != store.model_id:
        raise StoreError(f"model mismatch: the ring runs {model_id[:12]}, this node has {store.model_id[:12]}")
    if windows.relay:
        return
    if store is None:
        raise StoreError("this node was started without --model, so it can only be a relay")
    if windows.n_layers != store.config.n_layers:
        raise StoreError(f"the ring's model has {windows.n_layers} layers, this node's has {store.config.n_layers}")
