"""A TCP proxy that delays every byte by a fixed time, each way: a loopback ring whose links carry an added
latency, for benchmarks only (the product's nodes know nothing of it). A node's --peer points at the proxy in
front of its successor, so every ring hop passes one proxy.

    python -m tools.bench.delay_proxy --delay-ms 5 LISTEN_PORT=HOST:PORT [...]

Each chunk read is written to the other side `delay` after it arrived, in order; throughput is not limited.
"""

import argparse
import asyncio
import time


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def send() -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.get_running_loop().create_task(send())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay, data))
    except ConnectionError:
        pass
    queue.put_nowait(None)
    try:
        await sender
    except ConnectionError:
        pass


async def _serve(listen: int, target: str, delay: float) -> asyncio.Server:
    host, _, port = target.rpartition(":")

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer, delay), _pump(up_reader, writer, delay))

    return await asyncio.start_server(connection, "127.0.0.1", listen)


async def run(routes: dict[int, str], delay: float) -> None:
    servers = [await _serve(listen, target, delay) for listen, target in routes.items()]
    print("delay proxy ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("routes", nargs="+", help="LISTEN_PORT=HOST:PORT")
    args = ap.parse_args()
    routes = {int(r.split("=", 1)[0]): r.split("=", 1)[1] for r in args.routes}
    asyncio.run(run(routes, args.delay_ms / 1e3))


if __name__ == "__main__":
    main()
