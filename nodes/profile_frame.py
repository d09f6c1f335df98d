"""The software cost of one ring hop on this device, measured in-process.

Between the network and the compute, a node takes a frame apart and builds the next one: tensor
encode, protobuf serialise and parse, tensor decode, the inbox queue, a round trip through the compute
thread, the outbox queue. The PING round trip of the link probe covers the transport only; this
covers the rest, on this device's CPU (it adds up over the k M hops of a token).
"""

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from prima_rpc import codec
from prima_rpc.v1 import prima_pb2 as pb

ROUNDS = 300


def measure_frame_overhead(hidden: int, dtype: torch.dtype = torch.float32, rounds: int = ROUNDS) -> float:
    """Median seconds for one frame of one token's activation through a node's path (no compute)."""
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
    return statistics.median(times[20:])
