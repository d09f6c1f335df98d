"""Calibrate the profile's compute rates on the node's own path: decode steps through a Shard of the store.

One decoder layer timed alone (how the profiler first calibrated) ran faster than the same layers in a ring node
(SmolLM2 here: 0.8 vs 1.0 ms a layer, and predicted TPOTs 20-30 % low). A node runs its window through
nodes.engine.shard.Shard: one layer after another, each with its own weights, a KV cache of the reserve's
capacity, a growing context, each step after the rest of the ring's work. This times exactly that on the
store's first layers (as many as SWEEP_BYTES hold, at least one, so their weights come from memory, not
cache) and reports per-layer rates.
"""

import itertools
import logging
import math
import statistics
import threading
import time
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from nodes.engine.formats import weight_format
from nodes.engine.fused import layer_bytes
from nodes.engine.memory_room import probe_bytes
from nodes.engine.model import down_stage, gate_up_stage, rms_norm
from nodes.engine.prefetch import KV_RESERVE_TOKENS
from nodes.engine.quant import linear
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from prima_rpc.spec.shapes import layer_flops
from prima_rpc.spec.windows import Windows

BUDGET_S = 0.5
WARM_UP = 4
SWEEP_BYTES = 256 << 20
# Each step after a quiet gap, as the ring comes back to a node after the others' work: long enough for OpenMP's
# workers to stop spinning and sleep (3000 spins, prima_rpc/__init__.py), short of what this VM does to a machine
# left idle - one layer after 2 ms of quiet took 2.1-2.4 ms, after 1 ms 0.57-0.69, after 0.5 ms 0.46-0.58, back
# to back 0.42-0.45, right after another process's window (co-located nodes: the machine never idles) 0.60.
QUIET_S = 0.0005


def _fits_two_copies(store: LayerStore, n: int) -> bool:
    """Whether n layers twice over (a resident copy and a streamed one; a quantized layer also passes through a
    repacked copy as it loads) fit the room this process has. A device too small for that is profiled without the
    streaming probes: a 846 MiB one was killed running them on an 8B-shaped store."""
    need = 3 * n * store.entry("layer.0").bytes
    return probe_bytes(need, 1) >= need


def measure_node_layers(store_dir: Path, dtype: str) -> dict | None:
    """{"layer_s", "flops_rate", "bytes_rate", "layers"} of one decode step per layer through a node's
    Shard, or None for a store without weights."""
    store = LayerStore(store_dir)
    if store.manifest.manifest_only:
        return None
    cfg, torch_dtype = store.config, getattr(torch, dtype)
    nbytes = layer_bytes(cfg, torch_dtype)
    n = max(1, min(cfg.n_layers, probe_bytes(SWEEP_BYTES) // nbytes))
    shard = Shard(store, Windows(((0, n),), cfg.n_layers, False), torch_dtype, budget=0, depth=0)
    try:
        cache = shard.cache_for("profile", 0, min(KV_RESERVE_TOKENS, cfg.max_seq_len), 1)
        x = torch.randn(1, cfg.hidden).to(torch_dtype)
        times: list[float] = []
        deadline = time.perf_counter() + BUDGET_S
        for pos in range(cache.capacity):  # one token after another, as a request decodes
            time.sleep(QUIET_S)  # OpenMP's workers asleep, as a ring's node finds them
            start = time.perf_counter()
            shard.compute(x, cache, pos, 0)
            if pos >= WARM_UP:
                times.append(time.perf_counter() - start)
            if len(times) >= 5 and time.perf_counter() > deadline:
                break
    finally:
        shard.close()
    layer_s = statistics.fmean(times) / n  # TPOT is a mean over tokens: its slow steps count (median: 2-5 % less)
    return {"layer_s": layer_s, "flops_rate": layer_flops(cfg) / layer_s, "bytes_rate": nbytes / layer_s,
            "layers": n}


READ_SWEEP_BYTES = 64 << 20  # the layers measure_streaming streams (at least one)
READ_TOKENS = 8  # timed tokens each way, after WARM_UP
# the probe's least budget is below the streaming minimum on purpose: not the warning a node's real budget earns
_QUIET = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


def measure_streaming(store_dir: Path, dtype: str) -> dict | None:
    """{"read_cpu_s", "stream_layer_s", "layers"}: what streaming costs a node beyond its reads' time. The
    store's first layers run as decode steps through a Shard that holds them all, then through one that streams
    them all through a one-layer buffer (the node's own prefetcher, reader and copies, an emulated disk's
    pacing). read_cpu_s: the CPU difference a token over the bytes read, which the compute beside the reads
    loses on the machine's cores (a 3-node ring on 2 cores lost 18 ms of compute a token to 68 MB read, 0.27 ns
    a byte; this measures 0.17-0.35; a copy at RAM speed is 0.07). stream_layer_s: what a streamed layer's
    compute takes beyond a resident one's, stalls excluded (it starts cold, after waiting for its read: SmolLM2
    fp32 at 200 MB/s, 0.8-0.9 ms more than its 0.85). None for a store without weights."""
    store = LayerStore(store_dir)
    if store.manifest.manifest_only:
        return None
    cfg, torch_dtype = store.config, getattr(torch, dtype)
    n = max(1, min(cfg.n_layers, probe_bytes(READ_SWEEP_BYTES) // layer_bytes(cfg, torch_dtype)))
    if not _fits_two_copies(store, n):
        return None
    x = torch.randn(1, cfg.hidden).to(torch_dtype)
    per_token = []
    for budget in (0, 1):  # all resident; then the least budget: every layer streams
        shard = Shard(store, Windows(((0, n),), cfg.n_layers, False), torch_dtype, budget=budget,
                      buffer=layer_bytes(cfg, torch_dtype, weight_format(store.manifest)), log=_QUIET)
        try:
            cache = shard.cache_for("profile", 0, WARM_UP + READ_TOKENS, 1)
            for pos in range(WARM_UP + READ_TOKENS):
                if pos == WARM_UP:
                    cpu, compute, read = time.process_time(), shard.compute_s, store.bytes_read
                time.sleep(QUIET_S)  # as the ring comes back: the prefetcher reads ahead in the gap
                shard.compute(x, cache, pos, 0)
            per_token.append([(v / READ_TOKENS) for v in (time.process_time() - cpu, shard.compute_s - compute,
                                                         store.bytes_read - read)])
        finally:
            shard.close()
    (cpu, compute, _), (cpu_streaming, compute_streaming, nbytes) = per_token
    if not nbytes:
        return None
    return {"read_cpu_s": max(cpu_streaming - cpu, 0.0) / nbytes,
            "stream_layer_s": max(compute_streaming - compute, 0.0) / n, "layers": n}


# measure_read_loss: phases alone / beside a reader, in turn, each WARM_UP steps and then timed ones for at least
# LOSS_PHASE_S (and LOSS_MIN_STEPS). The loss comes in bursts, one a chunk handed over (4 MB, its copy and the
# wake-ups around it), so the phases' length, not their steps, bounds the noise: with 24 steps a phase a 200 MB/s
# reader handed over about 4 chunks, and 5 probes gave 2.17, 0.80, 0.00, 0.00, 0.02 ns a byte.
LOSS_PAIRS = 4
LOSS_PHASE_S = 0.3
LOSS_MIN_STEPS = 8
LOSS_MAX_STEPS = 400  # a bound on the KV positions each phase's cache holds


class _Reader:
    """A second reader beside the compute: a LayerStore of its own (the node's reader, its O_DIRECT chunks and
    copies, $PRIMA_DISK_MBPS's pacing) reading `units` in turn on its own thread, from start() to stop()."""

    def __init__(self, store_dir: Path, units: list[str]):
        self.store = LayerStore(store_dir, verify=False)  # a node's steady state: each file's checksum is read once
        self.units = units
        self.targets = {u: {name: torch.empty(span.shape, dtype=span.dtype) for name, span in
                            self.store.layout(u).items()}
                        for u in dict.fromkeys(units)}  # as stored: the reader's copies are plain bytes
        self.halt = threading.Event()
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self.halt.is_set():
            for u in self.units:
                if self.halt.is_set():
                    break
                self.store.read_into(u, self.targets[u])

    def start(self) -> None:
        self.halt.clear()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop reading (after the file being read: a failed step's cleanup waits for it too)."""
        self.halt.set()
        if self.thread is not None:
            self.thread.join()


def _decode_steps(shard: Shard, x: torch.Tensor, cache, pos: int, count: int) -> int:
    """count decode steps from pos, each after a quiet gap; returns the next position."""
    for _ in range(count):
        time.sleep(QUIET_S)
        shard.compute(x, cache, pos, 0)
        pos += 1
    return pos


def _timed_steps(shard: Shard, x: torch.Tensor, cache, pos: int, capacity: int, began: float) -> list[float]:
    """Decode steps from pos, each after a quiet gap, for at least LOSS_MIN_STEPS and LOSS_PHASE_S from began (or
    up to the cache's capacity): their times."""
    times = []
    while pos < capacity and (len(times) < LOSS_MIN_STEPS or time.perf_counter() - began < LOSS_PHASE_S):
        time.sleep(QUIET_S)
        start = time.perf_counter()
        shard.compute(x, cache, pos, 0)
        pos += 1
        times.append(time.perf_counter() - start)
    return times


def measure_read_loss(store_dir: Path, dtype: str) -> dict | None:
    """{"read_loss_s", "bytes_per_step", "layers", "steps"}: the compute time a node loses per byte another reader
    streams beside it - what a streamed byte costs the ring where it is read while a node computes. The store's
    first layers decode resident, alone and then with a second reader (a LayerStore of its own: the node's reader,
    its O_DIRECT chunks and copies, $PRIMA_DISK_MBPS's pacing) streaming other layers beside them, LOSS_PAIRS times
    in turn (a drift of the machine's speed falls on both); the loss is the difference of the steps' means over
    the bytes read while they computed. It is more than the reader's CPU (read_cpu_s): a reader that takes a core
    from the compute's spinning OpenMP team stalls the whole parallel region, and its copies take memory bandwidth
    (SmolLM2 fp32 beside a 1000 MB/s reader: 0.43-0.61 ns a byte where read_cpu_s was 0.30-0.32; a 3-node ring with
    three such readers lost 0.31-0.39). None for a store without weights or a reader that read nothing."""
    store = LayerStore(store_dir)
    if store.manifest.manifest_only:
        return None
    cfg, torch_dtype = store.config, getattr(torch, dtype)
    n = max(1, min(cfg.n_layers, probe_bytes(READ_SWEEP_BYTES) // layer_bytes(cfg, torch_dtype)))
    if not _fits_two_copies(store, n):
        return None
    units = [f"layer.{i % cfg.n_layers}" for i in range(n, 2 * n)]  # other layers where the store has them
    reader = _Reader(store_dir, units)
    shard = Shard(store, Windows(((0, n),), cfg.n_layers, False), torch_dtype, budget=0, depth=0)
    x = torch.randn(1, cfg.hidden).to(torch_dtype)
    steps = {False: [], True: []}
    bytes_computing = 0.0
    try:
        capacity = min(cfg.max_seq_len, WARM_UP + LOSS_MAX_STEPS)
        for phase, beside in enumerate((False, True) * LOSS_PAIRS):
            cache = shard.cache_for(f"profile-{phase}", 0, capacity, 1)
            if beside:
                reader.start()
            pos = _decode_steps(shard, x, cache, 0, WARM_UP)
            began, read = time.perf_counter(), reader.store.bytes_read
            times = _timed_steps(shard, x, cache, pos, capacity, began)
            if beside:  # the reader streams steadily: its bytes while computing are its share of the phase
                bytes_computing += (reader.store.bytes_read - read) * sum(times) / (time.perf_counter() - began)
                reader.stop()
            steps[beside] += times
            shard.release(f"profile-{phase}")
    finally:
        reader.stop()
        shard.close()
    per_step = bytes_computing / len(steps[True])
    if per_step <= 0:
        return None
    lost = statistics.fmean(steps[True]) - statistics.fmean(steps[False])
    return {"read_loss_s": max(lost, 0.0) / per_step, "bytes_per_step": per_step, "layers": n,
            "steps": len(steps[True]) + len(steps[False])}


BATCH_SIZES = (1, 2, 4, 8)  # decode rows a batch cost curve is measured at
BATCH_BUDGET_S = 0.12  # per size: the curve adds about half a second to a profile
BATCH_SWEEP_BYTES = 64 << 20  # weights cycled (past a last-level cache, as in decode), fewer than SWEEP_BYTES: quick
BATCH_POS = 64  # each request's context length while timing (attention is per request, over its own cache)


def measure_batch_cost(store_dir: Path, dtype: str) -> dict | None:
    """{"batch_cost": {b: cost of a decode step of b requests / of one}, "output_batch_cost": the same for the
    output layer, "step_s" and "output_s": {b: seconds}} per layer of the store's first layers, computed as a
    node computes a batch: every matrix once for all b rows (one pass over the weights; float or the store's
    quantized kernel), attention per request over its own KV cache; the head's output layer once for the b rows.
    None for a store without weights."""
    store = LayerStore(store_dir)
    if store.manifest.manifest_only:
        return None
    cfg, torch_dtype = store.config, getattr(torch, dtype)
    n = max(1, min(cfg.n_layers, probe_bytes(BATCH_SWEEP_BYTES) // layer_bytes(cfg, torch_dtype)))
    # the output layer too, where it fits a quarter of the room (a small device: its curve stands for the output's)
    head_units = sum(store.entry(u).bytes for u in ("embed", "head") if u in store.manifest.units())
    with_head = probe_bytes(head_units) >= head_units
    shard = Shard(store, Windows(((0, n),), cfg.n_layers, with_head), torch_dtype, budget=0, depth=0)
    try:
        caches = [shard.cache_for(f"profile-{r}", 0, 2 * BATCH_POS, 1) for r in range(max(BATCH_SIZES))]
        for c in caches:  # a context of BATCH_POS tokens (never uninitialised memory: denormals are slow)
            for kv in c.kv.values():
                kv.normal_(0, 0.1)
        # Each layer and the output timed alone, the fastest of each kept: on shared cores (other nodes, other
        # programs) the least time is the work's own, and a short piece of work often runs uninterrupted.
        best = {(b, i): math.inf for b in BATCH_SIZES for i in range(n + with_head)}  # i = n: the output layer
        xs = {b: torch.randn(b, cfg.hidden).to(torch_dtype) for b in BATCH_SIZES}
        deadline = time.perf_counter() + BATCH_BUDGET_S * len(BATCH_SIZES)
        with torch.inference_mode():
            for turn in itertools.count():  # sizes interleaved: a busy machine's drift hits them alike
                for b in BATCH_SIZES:
                    y = xs[b]
                    for i in range(n + with_head):
                        start = time.perf_counter()
                        if i < n:
                            y = _batched_layer(y, shard.layers[i], [c.kv[i] for c in caches[:b]], shard, cfg)
                        else:
                            shard.head.logits(xs[b], cfg.norm_eps)
                        if turn >= 1:  # the first turn warms up
                            best[b, i] = min(best[b, i], time.perf_counter() - start)
                if turn >= 3 and time.perf_counter() > deadline:
                    break
    finally:
        shard.close()
    step_s = {b: sum(best[b, i] for i in range(n)) / n for b in BATCH_SIZES}
    output_s = {b: best[b, n] if with_head else step_s[b] for b in BATCH_SIZES}
    return {"batch_cost": _curve(step_s), "output_batch_cost": _curve(output_s), "step_s": step_s,
            "output_s": output_s, "layers": n}


def _curve(seconds: dict[int, float]) -> dict[int, float]:
    """Costs relative to one row; noise aside, b rows in one pass cost at least as much as fewer rows, and no
    more than b passes of one."""
    curve, prev = {}, 1.0
    for b in BATCH_SIZES:
        curve[b] = prev = min(max(seconds[b] / seconds[1], prev), float(b))
    return curve


def _batched_layer(x: torch.Tensor, layer, kvs: list[torch.Tensor], shard: Shard, cfg) -> torch.Tensor:
    """One decoder layer for b requests at once (rows of x), each at position BATCH_POS of its own cache."""
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = linear(rms_norm(x, layer.attn_norm, cfg.norm_eps), layer.wqkv, layer.bqkv)
    rows = []
    for r, kv in enumerate(kvs):  # attention: per request
        heads = qkv[r:r + 1].view(1, nh + 2 * nkv, hd).transpose(0, 1)
        q, k = shard.rope.apply(heads[:nh + nkv], BATCH_POS).split([nh, nkv])
        kv[0, :, BATCH_POS:BATCH_POS + 1] = k
        kv[1, :, BATCH_POS:BATCH_POS + 1] = heads[nh + nkv:]
        att = F.scaled_dot_product_attention(q.unsqueeze(0), kv[0, :, :BATCH_POS + 1].unsqueeze(0),
                                             kv[1, :, :BATCH_POS + 1].unsqueeze(0), enable_gqa=nh != nkv)
        rows.append(att[0].transpose(0, 1).reshape(1, nh * hd))
    h = x + linear(torch.cat(rows), layer.wo)
    return down_stage(h, gate_up_stage(h, layer.ffn_norm, layer.w_gate_up, cfg), layer.w_down)
