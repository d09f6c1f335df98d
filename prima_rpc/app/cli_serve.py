"""`prima-ctl serve`: an OpenAI-compatible HTTP API in front of the ring's head (the --node)."""

import asyncio
import sys

import structlog
import typer

from prima_rpc.app.cli_args import Target
from prima_rpc.app.cli_errors import fail
from prima_rpc.app.cli_ring import reach
from prima_rpc.request import MAX_TOKENS, TEMPERATURE


def serve(ctx: typer.Context,
          host: str = typer.Option("127.0.0.1", help="address to bind (0.0.0.0: every interface)"),
          port: int = typer.Option(8000, help="HTTP port (0: any free port)"),
          max_tokens: int = typer.Option(1024, help="max_tokens for requests that give none"),
          temperature: float = typer.Option(None, help="temperature for requests that give none (default: the "
                                                       "model's sampling, as the page and the CLI; 0: greedy)")):
    """Serve /v1/chat/completions, /v1/completions and /v1/models over HTTP, forwarding to the head.

    With a token ($PRIMA_TOKEN or --token-file), clients must send it as their API key (Authorization: Bearer
    TOKEN).
    """
    from prima_rpc.app import openai_api  # aiohttp is needed by this command only

    if not 1 <= max_tokens <= MAX_TOKENS[1]:
        fail(f"--max-tokens must be in [1, {MAX_TOKENS[1]}], got {max_tokens}")
    if temperature is not None and not TEMPERATURE[0] <= temperature <= TEMPERATURE[1]:
        fail(f"--temperature must be in [{TEMPERATURE[0]:g}, {TEMPERATURE[1]:g}], got {temperature:g}")
    if not 0 <= port <= 65535:
        fail(f"--port must be in 0-65535, got {port}")
    target: Target = ctx.obj
    info = reach(target)
    if info.role != "head":
        print(f"warning: {target.node} is a {info.role} node, not a head; requests fail until the ring is "
              "started (prima-ctl start)", file=sys.stderr)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))  # as prima-node does
    config = openai_api.ApiConfig(head=target.node, token=target.token, default_max_tokens=max_tokens,
                                     default_temperature=temperature,
                                     members=tuple(a for a in target.nodes if a != target.node))

    def ready(url: str) -> None:
        print(f"serving {info.model_name or 'the ring'} from head {target.node} at {url} "
              "(Ctrl-C stops)", flush=True)

    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # Windows: the default loop
        run = asyncio.run
    try:
        run(openai_api.serve(config, host, port, ready=ready))
    except OSError as exc:
        fail(f"cannot serve on {host}:{port}: {exc.strerror or exc}; choose another --port")
    print("stopped", flush=True)
