"""A head that stops mid-stream with its connections still open (SIGSTOP for real; real prima-node processes on
loopback): its clients notice within channel.STALL_S by gRPC keepalive pings, not never. A client that knows every
member resumes on the new head with the reference's tokens, and so does the HTTP API's own path to the ring
(`prima-ctl --node A,B,C serve`); a client that knows the head alone ends with a clear UNAVAILABLE."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from prima_rpc.app.local_ring import free_ports
from prima_rpc.channel import STALL_S
from prima_rpc.client import PrimaClient, PrimaError, Token
from tests.rings import greedy_tokens, local_ring

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, a dragon who could not fly"  # raw text: a story that runs past MAX_TOKENS
MAX_TOKENS = 128
FAILOVER_S = 25  # after the stall is noticed: the ring's own failover (probes, a confirming probe, a re-plan)


class Stream:
    """One request's text and token ids as they come (and when), the moment it ended, and its error if it failed."""

    def __init__(self):
        self.tokens, self.text, self.stamps, self.ended, self.error = [], [], [], None, None
        self.going = asyncio.Event()  # set at its 2nd token: the head is mid-stream

    def first_after(self, moment: float) -> float:
        """How long after `moment` the next token came (the stream's gap across a stall)."""
        return min(t for t in self.stamps if t > moment) - moment

    def add(self, text: str, token_id: int | None = None) -> None:
        self.text.append(text)
        self.stamps.append(time.monotonic())
        self.tokens += [] if token_id is None else [token_id]
        if len(self.text) >= 2:
            self.going.set()


async def grpc_stream(addresses: list[str], out: Stream) -> None:
    try:
        async with PrimaClient(addresses) as client:
            async for event in client.generate(PROMPT, max_tokens=MAX_TOKENS, raw=True):
                if isinstance(event, Token):
                    out.add(event.text, event.token_id)
    except PrimaError as exc:
        out.error = exc
    finally:
        out.ended = time.monotonic()
        out.going.set()


async def http_stream(url: str, out: Stream) -> None:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    try:
        async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as res:
            assert res.status == 200, await res.text()
            async for line in res.content:
                data = line.decode().strip().removeprefix("data: ")
                if data and data != "[DONE]":
                    out.add(json.loads(data)["choices"][0]["text"])
    finally:
        out.ended = time.monotonic()
        out.going.set()


async def stall_the_head(pid: int, members: list[str], url: str) -> tuple[float, Stream, Stream, Stream]:
    """Three requests at once (a client of every member, one of the head alone, the HTTP API), the head SIGSTOPped
    once each is mid-stream; when it was stopped, and the three."""
    everyone, alone, http = Stream(), Stream(), Stream()
    tasks = [asyncio.create_task(grpc_stream(members, everyone)), asyncio.create_task(grpc_stream(members[:1], alone)),
             asyncio.create_task(http_stream(url, http))]
    await asyncio.wait_for(asyncio.gather(everyone.going.wait(), alone.going.wait(), http.going.wait()), 120)
    ended_before = [s.ended for s in (everyone, alone, http)]
    os.kill(pid, signal.SIGSTOP)  # it holds its sockets open and answers nothing, not even HTTP/2 pings
    stopped = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 300)  # decoding the rest on a loaded machine: minutes
    assert ended_before == [None] * 3, "a request ended before the head was stopped: make it longer"
    return stopped, everyone, alone, http


def test_a_head_stopped_mid_stream_is_noticed_and_the_stream_resumes_on_the_new_head(smol_store, tmp_path):
    expected = greedy_tokens(smol_store, PROMPT, MAX_TOKENS, raw=True)
    with local_ring(smol_store, 3, tmp_path, windows=[10, 10, 10]) as local:
        head = local.addresses[0]
        (port,) = free_ports(1)
        with open(tmp_path / "serve.log", "wb") as log:  # its request lines and the resume it logs
            serve = subprocess.Popen([sys.executable, "-m", "prima_rpc.app.cli", "--node", ",".join(local.addresses),
                                      "serve", "--port", str(port)], stdout=subprocess.PIPE, stderr=log, text=True)
        pid = local.processes[0].pid
        try:
            assert "serving" in serve.stdout.readline()
            stopped, everyone, alone, http = asyncio.run(stall_the_head(pid, local.addresses,
                                                                        f"http://127.0.0.1:{port}"))
        finally:
            os.kill(pid, signal.SIGCONT)
            serve.terminate()
            serve.communicate(timeout=15)
    assert everyone.error is None and everyone.tokens == expected  # resumed on the new head, as if nothing broke
    assert everyone.first_after(stopped) < STALL_S + FAILOVER_S  # noticed and resumed, not waited on forever
    assert "".join(http.text) == "".join(everyone.text) and http.first_after(stopped) < STALL_S + FAILOVER_S
    assert "resumed on the head" in (tmp_path / "serve.log").read_text()
    assert alone.error is not None and alone.error.code.name == "UNAVAILABLE", alone.error
    assert f"node {head} stopped answering" in str(alone.error)  # not a hang: the one address it knew is named
    assert alone.ended - stopped < STALL_S + 5
