"""`prima-ctl`: import and synthesise models, run the reference, and drive a ring of nodes."""

from pathlib import Path

import typer

from prima_rpc.app import cli_args, cli_lifecycle, cli_plan, cli_ring, cli_run, cli_serve, cli_status, cli_store
from prima_rpc.app.cli_errors import Typer, guarded

app = Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
            help="Control prima-rpc: import models, plan and start rings, generate text.")

# Every command, in the order `prima-ctl --help` lists them; the ring commands read the Target from ctx.obj.
COMMANDS = {
    "import": cli_store.import_, "synth": cli_store.synth, "run": cli_run.run,
    "start": cli_ring.start, "leave": cli_ring.leave,
    "status": cli_status.status, "generate": cli_ring.generate, "chat": cli_ring.chat,
    "up": cli_lifecycle.up, "down": cli_lifecycle.down, "plan": cli_plan.plan, "serve": cli_serve.serve,
}


@app.callback()
def main(ctx: typer.Context,
         node: str = typer.Option(None, "--node", show_default=False,
                                  help="HOST:PORT of any node of the ring (default: the local ring's head if one "
                                       f"is up, else {cli_args.DEFAULT_NODE})"),
         token_file: Path = typer.Option(None, "--token-file", metavar="PATH", show_default=False,
                                         help="a file holding the cluster secret (default: $PRIMA_TOKEN); "
                                              "never on the command line, where ps shows it")):
    ctx.obj = cli_args.target(node, token_file, ctx.invoked_subcommand)


RETRIED = ("start", "leave", "status", "generate", "plan")  # run again while the ring they meet changes (cli_errors)
for name, command in COMMANDS.items():
    app.command(name)(guarded(command, retried=name in RETRIED))


if __name__ == "__main__":  # python -m prima_rpc.app.cli
    app()
