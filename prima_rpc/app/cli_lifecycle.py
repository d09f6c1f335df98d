"""`prima-ctl up` and `down`: start a local ring (recorded by pid files, with its HTTP server), stop any ring."""

import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import typer

from prima_rpc.app import cli_args, ring
from prima_rpc.app.cli_args import Target
from prima_rpc.app.cli_errors import fail
from prima_rpc.app.cli_ring import assign_windows, reach, stream
from prima_rpc.app.progress import bar, mib, summary
from prima_rpc.app.rpc_message import rpc_message
from prima_rpc.channel import TOKEN_ENV
from prima_rpc.client import PrimaError
from prima_rpc.control import Control
from prima_rpc.request import GenerateRequest
from prima_rpc.spec.windows import even_windows


def up(ctx: typer.Context, local: int = typer.Option(3, "--local", help="nodes to start on this machine"),
       model: Path = typer.Option(None, help="store directory (default: SmolLM2, imported if missing)"),
       base_port: int = typer.Option(7000, help="the nodes serve on this port and the next ones"),
       windows: str = typer.Option(None, help="default: an even split"),
       prompt: str = typer.Option("What is the capital of France?", help="a first question to answer"),
       serve: int = typer.Option(None, "--serve", metavar="PORT",
                                 help="also serve the HTTP API and web page on this port"),
       reuse: bool = typer.Option(False, "--reuse", help="if this very ring is already up, use it")):
    """Start a local ring of N nodes on loopback, assign windows, and answer one prompt.

    Logs and pid files: $PRIMA_HOME/run/BASE_PORT/ (prima-ctl down --local stops the ring by them)."""
    from prima_rpc.app import local_ring

    sizes = _up_args(local, base_port, windows, serve, prompt)
    if model is None:
        model = _default_model()
    cli_args.store(model)
    running = local_ring.Recorded.read(local_ring.run_dir(base_port))
    alive = running.alive() if running else {}
    if alive and reuse:
        target, directory, serving = _reuse(ctx.obj, running, alive, local, model)
    else:
        target, directory, serving = _launch(ctx.obj, model, local, base_port, sizes, serve)
    if serve is not None and not serving:
        _start_server(target, directory, serve)
    failed = ""  # the first prompt's error: said last, after where the ring is and how to stop it
    if prompt:
        print(f"you> {prompt}", flush=True)
        try:
            first = GenerateRequest(prompt, max_tokens=64, temperature=None)  # the model's sampling, as chat's
            asyncio.run(stream(target, first, echo=True, prefix="model> "))
        except PrimaError as exc:
            failed = f"{rpc_message(exc.code, exc.message)} (logs in {directory})"
        print()
    _where(target, serve)
    if failed:
        fail(failed)


def _where(target, serve: int | None) -> None:
    """The page's address and the commands that chat with, show and stop the ring."""
    if serve is not None:
        print(f"web page: http://127.0.0.1:{serve}/    OpenAI API: http://127.0.0.1:{serve}/v1")
    ctl = _ctl_command()
    from prima_rpc.app.local_ring import recorded_rings

    heads = [r.addresses[0] for r in recorded_rings() if r.alive()]
    node = "" if heads == [target.node] else f" --node {target.node}"  # without --node: the one local ring
    print(f"chat: {ctl}{node} chat    the ring: {ctl}{node} status    stop: {ctl} down --local")


def _ctl_command() -> str:
    """prima-ctl as this shell can run it: by name when PATH finds this very one, else by its path
    (.venv/bin/prima-ctl, as make run starts it)."""
    import os
    import shutil

    me = sys.argv[0] if os.path.basename(sys.argv[0]) == "prima-ctl" else ""
    if not me:  # python -m prima_rpc.app.cli
        return f"{sys.executable} -m prima_rpc.app.cli"
    found = shutil.which("prima-ctl")
    if found and os.path.realpath(found) == os.path.realpath(me):
        return "prima-ctl"
    return me if os.sep in me else os.path.join(".", me)


def _default_model() -> Path:
    """SmolLM2, imported into $PRIMA_HOME/models the first time (with a bar and a summary line)."""
    from tools.importers import DEFAULT_DTYPE, default_store_dir, ensure_default_store

    if (default_store_dir(DEFAULT_DTYPE) / "manifest.json").is_file():
        return default_store_dir(DEFAULT_DTYPE)
    started = time.monotonic()
    summary("importing the default model, SmolLM2-135M-Instruct (once)")
    with bar("importing SmolLM2 (once)") as progress:
        model = ensure_default_store(progress=progress, dtype=DEFAULT_DTYPE)
    size = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    summary(f"imported SmolLM2 into {model}: {mib(size)} in {time.monotonic() - started:.1f} s")
    return model


def _up_args(local: int, base_port: int, windows: str | None, serve: int | None, prompt: str) -> list[int] | None:
    """up's options checked before anything starts; the --windows sizes (None: an even split)."""
    if not 1 <= local <= 64:
        fail(f"--local takes 1 to 64 nodes, got {local}")
    if not 1 <= base_port <= 65536 - local:
        fail(f"--base-port must leave room for {local} ports below 65536, got {base_port}")
    if serve is not None and not 1 <= serve <= 65535:
        fail(f"--serve takes a port in 1-65535, got {serve}")
    sizes = cli_args.windows(windows) if windows else None
    if sizes is not None and len(sizes) != local:
        fail(f"--windows gives {len(sizes)} windows for {local} nodes")
    cli_args.text(prompt, "--prompt")
    return sizes


def _reuse(target: Target, running, alive: dict, local: int, model: Path) -> tuple[Target, Path, bool]:
    """The recorded local ring, if it is this very ring and whole: (its head, its directory, serving HTTP)."""
    nodes = [n for n in running.commands if n.startswith("node")]
    if len(nodes) != local or str(model) not in running.commands["node0"]:
        fail(f"the local ring on {', '.join(running.addresses)} is not {local} nodes with {model}; "
             "stop it first: prima-ctl down --local")
    if len(alive) - ("serve" in alive) < len(nodes):
        fail(f"the local ring on {', '.join(running.addresses)} has lost nodes (logs in "
             f"{running.directory}); stop it (prima-ctl down --local) and start it again")
    target = replace(target, node=running.addresses[0])
    reach(target)
    print(f"reusing the local ring on {', '.join(running.addresses)}; logs in {running.directory}")
    return target, running.directory, "serve" in alive


def _launch(target: Target, model: Path, local: int, base_port: int, sizes: list[int] | None,
            serve: int | None) -> tuple[Target, Path, bool]:
    """A new local ring with its windows assigned: (its head, its log directory, serving HTTP: not yet)."""
    from prima_rpc.app import local_ring

    if serve is not None:
        local_ring.free_ports(1, serve, "--serve (the HTTP port)")  # the HTTP port too, before anything starts
    started = local_ring.launch(model, local, base_port, token=target.token)
    target = replace(target, node=started.addresses[0])
    try:
        n_layers = ring.walk(started.addresses[0], target.token)[0][1].n_layers
        assign_windows(target, sizes or even_windows(n_layers, local), logs=started.log_dir)
    except BaseException:  # nothing left half-started
        started.stop()
        raise
    print(f"ring ready: {local} nodes on {', '.join(started.addresses)}; logs in {started.log_dir}")
    return target, started.log_dir, False


def down(ctx: typer.Context,
         local: bool = typer.Option(False, "--local",
                                    help="stop the local rings by their pid files in $PRIMA_HOME/run (every one, "
                                         "or the one with --node), even if no node answers")):
    """Stop every node of the ring that answers (and, for a local ring, its HTTP server)."""
    from prima_rpc.app.local_ring import recorded_rings

    target: Target = ctx.obj
    if local:
        rings = [r for r in recorded_rings() if r.alive() and (not target.node_given or target.node in r.addresses)]
        if not rings:
            print("no local ring is running")
        for r in rings:
            stopped = r.stop()
            print(f"stopped the local ring on {', '.join(r.addresses)}: {', '.join(stopped)}")
        return
    recorded = next((r for r in recorded_rings() if target.node in r.addresses and r.alive()), None)
    reached, silent = _reachable(target)
    if not reached and recorded is None:
        reach(target)  # says why: unreachable, or the token refused
    for address in recorded.addresses if recorded else ():
        if address not in reached and address not in silent:
            silent.append(address)  # after a dead node: the walk never got there
    stopped = []
    for address in reached + silent:
        try:
            with Control(address, target.token) as peer:
                peer.shutdown()
            stopped.append(address)
        except grpc.RpcError:
            pass
    if recorded is not None:
        recorded.stop()  # wait for them to exit; the HTTP server and any node that did not answer too
    gone = [a for a in reached + silent if a not in stopped]
    print(f"stopped {len(stopped)} nodes" + (f"; {', '.join(gone)} did not answer (stopped already?)"
                                              if gone else ""))


def _reachable(target: Target) -> tuple[list[str], list[str]]:
    """(the nodes the walk from --node reached in ring order, the one it could not reach)."""
    reached, seen, address = [], set(), target.node
    while len(reached) <= ring.MAX_RING:
        try:
            with Control(address, target.token) as peer:
                info = peer.info()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                fail(rpc_message(exc.code(), exc.details(), address))
            return reached, [address]
        if info.node_id in seen:
            break
        seen.add(info.node_id)
        reached.append(address)
        address = info.peer
    return reached, []


def _start_server(target: Target, directory: Path, port: int) -> None:
    """`prima-ctl serve` detached, recorded with the ring (down --local stops it too); waits until it answers."""
    import os
    import urllib.request

    from prima_rpc.app import local_ring
    from prima_rpc.app.local_ring import LaunchError, LocalRing, Recorded, last_line

    local_ring.free_ports(1, port, "--serve (the HTTP port)")
    recorded = Recorded.read(directory)
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV} | ({TOKEN_ENV: target.token} if target.token
                                                                     else {})
    spawner = LocalRing(recorded.addresses, directory, env=env)
    proc = spawner.spawn("serve", [sys.executable, "-m", "prima_rpc.app.cli", "--node", target.node, "serve",
                                   "--port", str(port)], fresh=True)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                     headers={"Authorization": f"Bearer {target.token}"} if target.token else {})
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            said = last_line(spawner.log("serve"))
            raise LaunchError(f"the HTTP server exited with status {proc.returncode}"
                              + (f" saying {said!r}" if said else "") + f" (log: {spawner.log('serve')})")
        try:
            with urllib.request.urlopen(request, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise LaunchError(f"the HTTP server did not answer within 60 s (log: {spawner.log('serve')})") from None
            time.sleep(0.3)
