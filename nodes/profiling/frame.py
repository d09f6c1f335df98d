"""The software cost of one ring hop, and of the head's own per-token work, on this device, measured in-process.

Between the network and the compute, a node takes a frame apart and builds the next one: tensor
encode, protobuf serialise and parse, tensor decode, the inbox queue, a round trip through the compute
thread, the outbox queue. The PING round trip of the link probe covers the transport only; this
covers the rest, on this device's CPU (it adds up over the k M hops of a token). The head, once per
token, also hands the embedding and the logits through its compute thread, samples, detokenises and
sends the token's event, and runs the output layer: measured here too.

And a window visit costs more than its layers: a node's compute comes back to a window after the rest of
the ring has worked, its OpenMP workers asleep, so one layer visited after a quiet gap takes longer than a
layer inside a long window (SmolLM2 fp32 here: 0.58 ms against 0.45). A k-round ring pays that k times per
token on every node that holds layers: `measure_window_visit`.
"""

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from nodes.generation import head_step
from nodes.generation.state import GenerateParams, Generation
from prima_rpc import codec
from prima_rpc.v1 import prima_pb2 as pb

ROUNDS = 60
# Each round starts after this long of quiet, as the ring meets a node: idle while the others work. How long
# matters: after 3 ms a frame's path cost 0.12-0.19 ms and the head's token 0.17-0.27 ms, after 20 ms 0.42-0.44
# and 0.47-0.48 (SmolLM2 shapes, this shared 2-core VM); the ring's rounds of a large model are longer still.
# (A ring of short rounds, 6 rounds of 8 ms, measured its hops at 0.43-0.70 ms against this probe's 0.7-0.75 cold
# and 0.25-0.3 after 3 ms: charging them by the gap k rounds leave predicted worse than this figure.)
IDLE_S = 0.02
VISITS = 12
EVICT_BYTES = 128 << 20  # read between two timed output projections: more than a last-level cache holds


def evict_bytes() -> int:
    """EVICT_BYTES, or an eighth of the room this process still has (a small device, a container)."""
    from nodes.engine.memory_room import probe_bytes

    return probe_bytes(EVICT_BYTES, 8)


def measure_frame_overhead(hidden: int, dtype: torch.dtype = torch.float32, rounds: int = ROUNDS) -> float:
    """Mean seconds for one frame of one token's activation through a node's path (no compute)."""
    if hidden < 1 or rounds < 1:
        raise ValueError(f"hidden and rounds must be >= 1, got {hidden}, {rounds}")
    return asyncio.run(_measure(hidden, dtype, rounds))


async def _measure(hidden: int, dtype: torch.dtype, rounds: int) -> float:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    x = torch.randn(1, hidden).to(dtype)
    times = []
    with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
        for i in range(rounds + 20):  # the first 20 warm up
            await asyncio.sleep(IDLE_S)
            start = time.perf_counter()
            wire = pb.Frame(request_id="profile", kind=pb.FORWARD, start_pos=i, next_layer=1,
                            hidden=codec.encode(x)).SerializeToString()
            frame = pb.Frame.FromString(wire)
            await inbox.put(codec.decode(frame.hidden))
            hidden_in = await inbox.get()
            out = await loop.run_in_executor(pool, torch.clone, hidden_in)
            await outbox.put(pb.Frame(request_id=frame.request_id, kind=pb.FORWARD, hidden=codec.encode(out)))
            await outbox.get()
            times.append(time.perf_counter() - start)
    return statistics.fmean(times[20:])  # a mean, as TPOT is over tokens


def measure_token_overhead(vocab: int, hidden: int, dtype: torch.dtype = torch.float32, text=None,
                           rounds: int = ROUNDS) -> float:
    """Median seconds of the head's own work per token besides its layers and output layer, as the head does
    it (nodes/ring/head.py): the step handed to its scheduler task (nodes/ring/steps.py), the embedding and the
    logits each handed through the compute thread, the waiter the ring's answer resolves, greedy sampling over the
    vocabulary and detokenising (text: a nodes.generation.text.TextCodec, when the store has a tokenizer) - the
    embedding, logits, sampling and detokenising by the head's own code, nodes/generation/head_step.py - and the
    token's Generate event written to a real gRPC stream (a loopback client reads it): the write alone took
    0.25-0.35 ms a token here, a third of what the probe missed without it."""
    if vocab < 1 or hidden < 1 or rounds < 1:
        raise ValueError(f"vocab, hidden and rounds must be >= 1, got {vocab}, {hidden}, {rounds}")
    return asyncio.run(_measure_token(vocab, hidden, dtype, text, rounds))


async def _measure_token(vocab: int, hidden: int, dtype: torch.dtype, text, rounds: int) -> float:
    times: list[float] = []

    async def tokens(request, context):
        async for event in _token_rounds(vocab, hidden, dtype, text, rounds, times):
            yield event

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "prima.Probe", {"Tokens": grpc.unary_stream_rpc_method_handler(tokens)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    def read() -> None:  # the client, in its own thread as it is in its own process
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in channel.unary_stream("/prima.Probe/Tokens")(b""):
                pass

    try:
        await asyncio.to_thread(read)
    finally:
        await server.stop(None)
    return statistics.median(times[20:])  # not a mean: the client's thread in this process adds rare waits of
    # several ms (the GIL) that the head, whose client is another process, does not see (mean 1.4-2 ms here)


async def _token_rounds(vocab: int, hidden: int, dtype: torch.dtype, text, rounds: int, times: list[float]):
    """The head's per-token path, `rounds` + 20 times (the first 20 warm up), each time in `times`: the head's
    own code for the embedding, the logits and the sampling and detokenising (nodes/generation/head_step.py)."""
    loop = asyncio.get_running_loop()
    table = torch.randn(256, hidden).to(dtype)  # a lookup costs the same in a vocabulary-sized table
    logits = torch.randn(vocab)
    ids = torch.randint(0, min(vocab, 32000), (rounds + 20,)).tolist()
    top = float(logits.max())
    gen = Generation(ids[:1], GenerateParams(max_tokens=rounds + 20), text if text is not None else _NoText(), (),
                     rounds + 22)  # greedy, as the head's default; no EOS: every round yields its token
    kick, steps = asyncio.Event(), []

    async def scheduler() -> None:  # the head's step scheduler: its own task, woken by each step handed in
        while True:
            await kick.wait()
            kick.clear()
            steps.pop().set_result(None)

    task = loop.create_task(scheduler())
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
            for i in range(rounds + 20):
                logits[ids[i]] = top + 1 + i  # greedy sampling picks ids[i]: real tokens to detokenise
                await asyncio.sleep(IDLE_S)
                start = time.perf_counter()
                steps.append(loop.create_future())
                kick.set()
                await steps[-1]
                x = await head_step.embed(pool, table.__getitem__, [ids[i] % 256])
                waiter = loop.create_future()
                loop.call_soon(waiter.set_result, x)  # the ring's answer arrives on the event loop
                answer = await waiter
                # Logits handed back, not computed: a parallel kernel here would leave OpenMP workers in this
                # thread (see profiler.profile_device); the output layer is measure_output_layer's.
                (out,) = await head_step.next_tokens(gen, pool, lambda h: logits, answer, [])
                yield pb.GenerateEvent(token=pb.TokenEvent(token_id=out.token_id, text=out.text, index=out.index,
                                                           elapsed_ms=start)).SerializeToString()
                times.append(time.perf_counter() - start)  # back once the stream took the event
    finally:
        task.cancel()


class _NoText:
    """A store without a tokenizer: nothing to detokenise."""

    def decode(self, ids: list[int]) -> str:
        return ""


def measure_output_layer(store_dir, dtype: str, budget_s: float = 0.3, bytes_rate: float = 0.0) -> float:
    """Mean seconds of the store's final norm and output projection for one token (0.0 without weights):
    a vocabulary-sized GEMV, which runs at its own rate, not the decoder layer's the profile calibrates on.
    Each one after other weights went through the caches, as a token's layers pass between two: back to back,
    the last-level cache kept part of the matrix (SmolLM2 fp32 here: 2.7 ms against 3.0-3.1, the ring's 3.1).
    Where the embedding and output units would take over half the memory this process may still take (a small
    device that will not be the head), their bytes at `bytes_rate` (the decode calibration's) stand for it."""
    from nodes.engine.formats import weight_format
    from nodes.engine.loading import load_head
    from nodes.engine.memory_room import cgroup_room
    from nodes.engine.store import LayerStore

    store = LayerStore(store_dir)
    if store.manifest.manifest_only:
        return 0.0
    room = cgroup_room()
    units = store.entry("head").bytes + (store.entry("embed").bytes if "embed" in store.manifest.units() else 0)
    if room is not None and units > room // 2:
        return store.entry("head").bytes / bytes_rate if bytes_rate > 0 else 0.0
    cfg, torch_dtype = store.config, getattr(torch, dtype)
    head = load_head(store, cfg, torch_dtype, weight_format(store.manifest))  # as a node holds it (quantized too)
    x = torch.randn(1, cfg.hidden).to(torch_dtype)
    other = torch.ones(evict_bytes() // 4)
    times: list[float] = []
    with torch.inference_mode():
        head.logits(x, cfg.norm_eps)  # warm-up
        deadline = time.perf_counter() + budget_s
        while time.perf_counter() < deadline or len(times) < 5:
            other.sum()
            start = time.perf_counter()
            head.logits(x, cfg.norm_eps)
            times.append(time.perf_counter() - start)
    return statistics.fmean(times)  # a mean, as TPOT is over tokens


def measure_window_visit(store_dir, dtype: str, layer_s: float, visits: int = VISITS) -> float:
    """Seconds a window visit costs beyond its layers' decode time (layer_s each: profile_compute's rate, its
    steps also after a quiet gap, over many layers): the mean of one-layer visits, each after the same gap
    (profile_compute.QUIET_S), less layer_s; 0.0 without weights. Before each gap other weights go through the
    caches, as the rest of the ring's do: one layer visited again and again stayed in the last-level cache
    (SmolLM2 fp32: 0.37-0.44 ms a visit against 0.47 a layer of the calibration's sweep). The compute thread's
    hand-off is frame_s's."""
    from nodes.engine.prefetch import KV_RESERVE_TOKENS
    from nodes.engine.shard import Shard
    from nodes.engine.store import LayerStore
    from nodes.profiling.compute import QUIET_S
    from prima_rpc.spec.windows import Windows

    store = LayerStore(store_dir)
    if store.manifest.manifest_only:
        return 0.0
    cfg, torch_dtype = store.config, getattr(torch, dtype)
    shard = Shard(store, Windows(((0, 1),), cfg.n_layers, False), torch_dtype, budget=0, depth=0)
    try:
        cache = shard.cache_for("profile", 0, min(KV_RESERVE_TOKENS, cfg.max_seq_len), 1)  # as a node's
        x = torch.randn(1, cfg.hidden).to(torch_dtype)
        other = torch.ones(evict_bytes() // 4)
        times = []
        for pos in range(visits + 2):  # the first 2 warm up
            other.sum()
            time.sleep(QUIET_S)
            start = time.perf_counter()
            shard.compute(x, cache, pos, 0)
            times.append(time.perf_counter() - start)
    finally:
        shard.close()
    return max(0.0, statistics.fmean(times[2:]) - layer_s)  # a mean, as TPOT is over tokens
