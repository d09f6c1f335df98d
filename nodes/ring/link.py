"""The outbound Ring stream to the successor: opened lazily, re-opened after it drops."""

import asyncio

import grpc
import structlog

from nodes.errors import LinkDown
from nodes.ring import frames
from prima_rpc.channel import aio_channel, metadata
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc

log = structlog.get_logger()


class RingLink:
    def __init__(self, peer: str, token: str | None):
        self.peer, self.token = peer, token
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._acks: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    def _open(self):
        if self._channel is None:
            self._channel = aio_channel(self.peer)
        self._call = rpc.RingStub(self._channel).Stream(metadata=metadata(self.token))
        self._reader = asyncio.get_running_loop().create_task(self._read_acks(self._call), name="ring-acks")
        return self._call

    async def _read_acks(self, call) -> None:
        try:
            async for ack in call:
                fut = self._acks.pop(ack.seq, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if isinstance(exc, grpc.aio.AioRpcError):
                log.warning("ring stream closed", peer=self.peer, code=exc.code().name, details=exc.details())
        finally:
            if self._call is call:
                self._call = None

    async def send(self, frame: pb.Frame) -> None:
        """Write one frame; one re-open is tried if the stream had dropped."""
        for attempt in range(2):
            call = self._call or self._open()
            try:
                await call.write(frame)
                return
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                self._call = None
                if attempt:
                    raise LinkDown(f"successor {self.peer} unreachable: {exc}") from None

    async def ping(self, seq: int, timeout: float = 5.0) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._acks[seq] = fut
        await self.send(frames.ping(seq))
        await asyncio.wait_for(fut, timeout)

    async def close(self, drain: float = 0.0) -> None:
        """drain: seconds to let the frames already written reach the peer (half-close, wait for its end)."""
        if drain and self._call is not None and self._reader is not None:
            try:
                await asyncio.wait_for(self._call.done_writing(), drain)
                await asyncio.wait_for(asyncio.shield(self._reader), drain)
            except (TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._call = None
