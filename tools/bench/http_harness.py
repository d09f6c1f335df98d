"""The HTTP API in a thread of this process in front of a ring, and one raw request to it as a client sends it:
what the fuzzer and the chaos soak share."""

import asyncio
import contextlib
import http.client
import queue
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

from prima_rpc.app.openai_api import ApiConfig, serve


@contextlib.contextmanager
def api_in_thread(config: ApiConfig) -> Iterator[str]:
    """`prima-ctl serve`'s HTTP API on a free loopback port, run by a background thread's event loop; yields its
    root URL (http://127.0.0.1:PORT)."""
    started: queue.Queue = queue.Queue()
    loop_and_stop = []

    async def main():
        stop = asyncio.Event()
        loop_and_stop.extend([asyncio.get_running_loop(), stop])
        try:
            await serve(config, "127.0.0.1", 0, ready=started.put, stop=stop)
        except BaseException as exc:  # handed to the caller's thread below
            started.put(exc)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True, name="http-api")
    thread.start()
    url = started.get(timeout=60)
    if isinstance(url, BaseException):
        raise url
    try:
        yield url.removesuffix("/v1")
    finally:
        loop, stop = loop_and_stop
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)


def post(root: str, path: str, body: bytes, timeout: float = 120.0) -> tuple[int, bytes]:
    """POST `body` (any bytes) as JSON to root+path; the status and the whole response (a stream read to its end)."""
    where = urlsplit(root)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def post_stream(root: str, path: str, body: bytes, timeout: float = 120.0) -> tuple[int, list[tuple[float, bytes]]]:
    """POST as `post`, the response read line by line as it comes: the status and (monotonic time, line) pairs."""
    where = urlsplit(root)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        res = conn.getresponse()
        lines = []
        while line := res.readline():
            if line.strip():
                lines.append((time.monotonic(), line.strip()))
        return res.status, lines
    finally:
        conn.close()
