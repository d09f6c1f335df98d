"""`prima-ctl serve`: an OpenAI-compatible HTTP API in front of the ring's head (the --node)."""

import asyncio
import sys

import structlog
import typer

from prima_rpc.app import ring
from prima_rpc.app.cli_errors import fail, guarded
from prima_rpc.channel import metadata
from prima_rpc.v1 import prima_pb2 as pb


def register(app: typer.Typer, state: dict) -> None:
    @app.command()
    @guarded
    def serve(host: str = typer.Option("127.0.0.1", help="address to bind (0.0.0.0: every interface)"),
              port: int = typer.Option(8000, help="HTTP port (0: any free port)"),
              max_tokens: int = typer.Option(1024, help="max_tokens for requests that give none")):
        """Serve /v1/chat/completions, /v1/completions and /v1/models over HTTP, forwarding to the head.

        With --token, clients must send it as their API key (Authorization: Bearer TOKEN).
        """
        from prima_rpc.app import openai_api  # aiohttp is needed by this command only

        if max_tokens < 1:
            fail(f"--max-tokens must be positive, got {max_tokens}")
        info = ring.control(state["node"]).Info(pb.InfoRequest(), metadata=metadata(state["token"]), timeout=5)
        if info.role != "head":
            print(f"warning: {state['node']} is a {info.role} node, not a head; requests fail until the ring is "
                  "started (prima-ctl start)", file=sys.stderr)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))  # as prima-node does
        config = openai_api.ApiConfig(head=state["node"], token=state["token"], default_max_tokens=max_tokens)

        def ready(url: str) -> None:
            print(f"serving {info.model_name or 'the ring'} from head {state['node']} at {url} "
                  "(Ctrl-C stops)", flush=True)

        try:
            import uvloop

            run = uvloop.run
        except ImportError:  # Windows: the default loop
            run = asyncio.run
        run(openai_api.serve(config, host, port, ready=ready))
        print("stopped", flush=True)
