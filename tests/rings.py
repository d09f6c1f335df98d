"""What the ring tests share: real prima-node processes on loopback (started, assigned, stopped), one request's
tokens from a head, the single-process greedy reference every ring must equal, and raw frames for a node."""

import asyncio
import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from prima_rpc.app import ring
from prima_rpc.app.local_ring import LocalRing, launch
from prima_rpc.channel import aio_channel
from prima_rpc.client import Finished, PrimaClient, Token
from prima_rpc.spec.manifest import MANIFEST
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc


@contextmanager
def local_ring(model: Path | None, n: int, log_dir: Path, windows: list[int] | None = None,
               token: str | None = None, **launch_args) -> Iterator[LocalRing]:
    """n nodes on free loopback ports (launch's arguments), assigned `windows` when given, stopped on the way out."""
    local = launch(model, n, log_dir=log_dir, detach=False, token=token, **launch_args)
    try:
        if windows is not None:
            ring.start(local.addresses[0], windows, token=token)
        yield local
    finally:
        local.stop()


SECRET = "correct horse battery staple"  # the cluster token of the shared secured rings (conftest.py)


class Rings:
    """Local rings of one store (and token) by size and nodes' extra arguments, each started at its first use and
    kept until close(): `rings(n, windows, extra_args)`, assigned `windows` (head first) on every call that gives
    them."""

    def __init__(self, store: Path, log_dir: Callable[[str], Path], token: str | None = None):
        self.store, self.log_dir, self.token = store, log_dir, token
        self.started: dict[tuple, LocalRing] = {}

    def __call__(self, n: int, windows: list[int] | None = None,
                 extra_args: list[list[str]] | None = None) -> LocalRing:
        key = ring_key(n, extra_args)
        if key not in self.started:
            self.started[key] = launch(self.store, n, log_dir=self.log_dir(f"ring{n}"), detach=False,
                                       extra_args=extra_args, token=self.token)
        if windows is not None:
            ring.start(self.started[key].addresses[0], windows, token=self.token)
        return self.started[key]

    def restore(self, n: int, extra_args: list[list[str]] | None = None) -> None:
        """Ring n as it was started, for a module that reads from it after others: one that is not (a node gone,
        the successors rewired, a request still held) is stopped, to start afresh at its next use."""
        key = ring_key(n, extra_args)
        local = self.started.get(key)
        if local is not None and not as_started(local, self.token):
            local.stop()
            del self.started[key]

    def close(self) -> None:
        for local in self.started.values():
            local.stop()
        self.started.clear()


def ring_key(n: int, extra_args: list[list[str]] | None) -> tuple:
    return n, tuple(tuple(a) for a in extra_args or ())


def as_started(local: LocalRing, token: str | None = None) -> bool:
    """Every node of `local` alive, wired in its first order and holding no request."""
    if any(p.poll() is not None for p in local.processes):
        return False
    try:
        return ([a for a, _ in ring.walk(local.addresses[0], token)] == local.addresses
                and released(local.addresses[0], token=token))
    except ring.RingError:
        return False


@functools.lru_cache(maxsize=2)
def _reference_model(store: Path, manifest_mtime_ns: int) -> ReferenceModel:
    return ReferenceModel(store)  # generating keeps no state in it: each generation has a KV cache of its own


def greedy_reference(store: Path, prompts: list[str], max_tokens: int, raw: bool = False) -> dict[str, list[int]]:
    """Each prompt's greedy token ids from the single process: what every ring must give. The model is loaded once
    for the tests that ask about the same store (SmolLM2: 2-6 s a load on 2 cores), again if its manifest changed."""
    store = Path(store).resolve()
    model = _reference_model(store, (store / MANIFEST).stat().st_mtime_ns)
    return {p: [t.token_id for t in model.generate(p, GenerateParams(max_tokens=max_tokens), raw=raw)]
            for p in prompts}


def greedy_tokens(store: Path, prompt: str, max_tokens: int, raw: bool = False) -> list[int]:
    return greedy_reference(store, [prompt], max_tokens, raw)[prompt]


async def stream(address: str, prompt: str, max_tokens: int, token: str | None = None,
                 **kwargs) -> tuple[list[int], Finished | None]:
    """One request's token ids and its final event, from the head at `address`."""
    tokens, done = [], None
    async with PrimaClient(address, token) as client:
        async for event in client.generate(prompt, max_tokens=max_tokens, **kwargs):
            if isinstance(event, Token):
                tokens.append(event.token_id)
            else:
                done = event
    return tokens, done


def collect(address: str, prompt: str, max_tokens: int, token: str | None = None,
            **kwargs) -> tuple[list[int], Finished | None]:
    """`stream` run to its end from synchronous code."""
    return asyncio.run(stream(address, prompt, max_tokens, token, **kwargs))


def collect_all(address: str, prompts: list[str], max_tokens: int,
                **kwargs) -> list[tuple[list[int], Finished | None]]:
    """`stream` for every prompt at once (concurrent requests), in the prompts' order."""
    async def gather():
        return await asyncio.gather(*(stream(address, p, max_tokens, **kwargs) for p in prompts))

    return asyncio.run(gather())


async def stream_and_signal(address: str, prompt: str, max_tokens: int, pid: int, sig: int,
                            after: int) -> tuple[list[int], Finished | None, float]:
    """One request's token ids, its final event and the longest gap between two tokens, with `sig` sent to
    process `pid` once `after` tokens are in."""
    tokens, stamps, done = [], [], None
    async with PrimaClient(address) as client:
        async for event in client.generate(prompt, max_tokens=max_tokens):
            if isinstance(event, Token):
                tokens.append(event.token_id)
                stamps.append(time.monotonic())
                if len(tokens) == after:
                    os.kill(pid, sig)
            else:
                done = event
    return tokens, done, max(b - a for a, b in zip(stamps, stamps[1:]))


def released(address: str, timeout: float = 10.0, token: str | None = None) -> bool:
    """Every node's KV caches freed (RELEASE frames go round the ring after the last token), waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(info.stats.active_requests == 0 for _, info in ring.walk(address, token)):
            return True
        time.sleep(0.1)
    return False


async def send_frames(address: str, *frames: pb.Frame, unlimited: bool = False) -> grpc.aio.AioRpcError | None:
    """Frames written straight to a node's Ring service; the status it ends the stream with, if not OK."""
    # unlimited: a client that ignores our send limit, to reach the server's receive limit
    options = [("grpc.max_send_message_length", -1)]
    channel = grpc.aio.insecure_channel(address, options=options) if unlimited else aio_channel(address)
    async with channel:
        call = rpc.RingStub(channel).Stream()
        for frame in frames:
            await call.write(frame)
        await call.done_writing()
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc
    return None
