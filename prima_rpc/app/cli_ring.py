"""`prima-ctl` commands that talk to a live ring: start, status, generate, chat."""

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import grpc
import typer
from rich import box
from rich.table import Table

from prima_rpc.app import cli_args, ring, tables
from prima_rpc.app.cli_errors import fail, guarded, rpc_message
from prima_rpc.app.progress import bar
from prima_rpc.app.status_rows import ring_prediction, status_row
from prima_rpc.channel import metadata
from prima_rpc.client import Finished, PrimaClient, PrimaError, Token, check_speculate, check_text
from prima_rpc.v1 import prima_pb2 as pb


def register(app: typer.Typer, state: dict) -> None:
    @app.command()
    @guarded
    def start(windows: str = typer.Option(None, help="layers per node in ring order from --node: 8,8,14; 0 = relay"),
              plan: Path = typer.Option(None, help="a plan saved by `prima-ctl plan --out`")):
        """Assign windows to the ring (the --node becomes the head) and wait until every node has loaded.

        Without --windows or --plan: profile the live ring, solve Halda, and apply its plan."""
        predicted, batching = None, (0, 0)
        if windows is not None:
            sizes, members, buffers = cli_args.windows(windows), None, None
        reach(state)
        if windows is None:
            sizes, members, buffers, predicted, batching = _plan_windows(state, plan)
        nodes = _start(state, sizes, members, buffers, predicted=predicted, batching=batching)
        print(f"ring ready: {len(nodes)} nodes, head {state['node']}")

    @app.command()
    @guarded
    def status(json_out: bool = typer.Option(False, "--json", help="print JSON (with --watch: one line per refresh)"),
               watch: float = typer.Option(None, "--watch", metavar="SECONDS",
                                           help="refresh every SECONDS until Ctrl-C")):
        """Every member in ring order with its state (up, lost, rejoining, fetching): role, windows, memory, timings."""
        if watch is None:
            try:
                rows = [status_row(*member) for member in ring.status(state["node"], state["token"])]
            except ring.RingError as exc:
                fail(str(exc))
            if json_out:
                print(json.dumps({"nodes": rows, **ring_prediction(rows)}, indent=1))
            else:
                tables.show(_status_table(state["node"], rows))
            return
        if watch < 0.1:
            fail(f"--watch needs at least 0.1 seconds, got {watch}")
        _watch(state, watch, json_out)

    @app.command()
    @guarded
    def generate(prompt: str = typer.Argument(...), max_tokens: int = typer.Option(128),
                 temperature: float = typer.Option(0.0), top_k: int = typer.Option(0),
                 top_p: float = typer.Option(1.0), seed: int = typer.Option(None),
                 stop: list[str] = typer.Option([], help="stop string (repeatable)"),
                 raw: bool = typer.Option(False), json_out: bool = typer.Option(False, "--json"),
                 speculate: str = typer.Option("", help="off | ngram (prompt lookup) | draft; default: the head's"),
                 draft_tokens: int = typer.Option(0, help="most tokens drafted per ring trip (1-16; 0: default)")):
        """Stream a completion from the ring's head (the --node)."""
        cli_args.generate_args(prompt, max_tokens, temperature, top_k, top_p, seed, stop)
        try:
            check_speculate(speculate, draft_tokens)
        except ValueError as exc:
            fail(str(exc))
        reach(state)
        kwargs = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      stop=tuple(stop), raw=raw, speculate=speculate, draft_tokens=draft_tokens)
        tokens, text, done = asyncio.run(_stream(state, prompt, None, kwargs, echo=not json_out))
        if json_out:
            print(json.dumps({"tokens": tokens, "text": text, "prompt_tokens": done.prompt_tokens,
                              "finish_reason": done.finish_reason, "ttft_ms": done.ttft_ms, "tpot_ms": done.tpot_ms,
                              "drafted": done.drafted, "accepted": done.accepted}))
        else:
            print()

    @app.command()
    @guarded
    def chat(max_tokens: int = typer.Option(256), temperature: float = typer.Option(0.0)):
        """An interactive chat with the ring (empty line or Ctrl-D ends it; Ctrl-C stops an answer).

        A failed turn prints its error and the chat goes on; the exit status is 1 if any turn failed."""
        cli_args.generate_args("", max_tokens, temperature, 0, 1.0, None, [])
        reach(state)
        messages: list[dict] = []
        failed = False
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                break
            except UnicodeDecodeError:  # a UTF-8 terminal got other bytes
                line = "\udcff"  # refused below, as under a C locale (surrogate-escaped bytes)
            if not line:
                break
            try:
                check_text(line, "your message")
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr, flush=True)
                failed = True
                continue
            print("model> ", end="", flush=True)
            turn = messages + [{"role": "user", "content": line}]
            try:
                _, text, _ = asyncio.run(_stream(state, "", turn, dict(max_tokens=max_tokens,
                                                                        temperature=temperature), echo=True))
                messages = turn + [{"role": "assistant", "content": text}]
                print()
            except PrimaError as exc:  # the turn is dropped from the history; the chat goes on
                print(flush=True)
                print(f"error: {rpc_message(exc.code, exc.message)}", file=sys.stderr, flush=True)
                failed = True
            except KeyboardInterrupt:
                print(" [stopped]", flush=True)
        if failed:
            raise typer.Exit(1)


def reach(state: dict) -> pb.NodeInfo:
    """The --node's Info, or a one-line error: unreachable, or the token refused."""
    try:
        with ring.control(state["node"]) as stub:
            return stub.Info(pb.InfoRequest(), metadata=metadata(state["token"]), timeout=5)
    except grpc.RpcError as exc:
        fail(rpc_message(exc.code(), exc.details(), state["node"]))


def _plan_windows(state: dict, plan_file: Path | None):
    """Windows in ring order from a saved or freshly solved plan, which devices stay in the ring
    (removed ones are routed around; relays stay), their stream buffers in layers (0: default), and the plan's
    prediction: (each device's per-token compute and stalls, turn_ms, and the TPOT, in ms) or None."""
    if plan_file is not None:
        try:
            result = json.loads(plan_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            fail(f"cannot read plan {plan_file}: {exc}")
    else:
        from prima_rpc.app.live_plan import plan_live

        result = plan_live(state["node"], state["token"], "halda", refresh=False)
    if "infeasible" in result:
        fail(f"the plan is infeasible: {result['infeasible']}")
    for d in result.get("devices", []):  # nodes without the model fetch their layers first
        if d.get("fetch_bytes"):
            print(f"{d['name']} must fetch {d['fetch_bytes'] / 2**20:.0f} MiB (~{d['fetch_s']:.1f} s at its measured "
                  "link)", file=sys.stderr)
    if result.get("first_start_s"):
        print(f"first start: ~{result['first_start_s']:.1f} s of fetching before the layers load", file=sys.stderr)
    try:
        devices = result["devices"]
        predicted = None
        if all("turn_ms" in d for d in devices) and "predicted_tpot_ms" in result:
            predicted = ([float(d["turn_ms"]) for d in devices], float(result["predicted_tpot_ms"]))
        # A plan for several requests at once caps the batches as it priced them; one for a single request
        # leaves the nodes' defaults (its max_batch of 1 would only forbid batching more users than planned).
        batching = (int(result["max_batch"]), int(result["micro_batches"])) \
            if int(result.get("concurrency", 1)) > 1 else (0, 0)
        return ([int(d["window"]) for d in devices], [d.get("role") != "removed" for d in devices],
                [float(d.get("buffer_layers", 0.0)) for d in devices], predicted, batching)
    except (KeyError, TypeError, ValueError, AttributeError):
        fail("the plan has no valid devices list")


def _walk(state: dict):
    try:
        return ring.walk(state["node"], state["token"])
    except ring.RingError as exc:
        fail(str(exc))


def _start(state: dict, sizes: list[int], members: list[bool] | None = None, buffers: list[float] | None = None,
           logs: Path | None = None, predicted: tuple[list[float], float] | None = None,
           batching: tuple[int, int] = (0, 0)):
    loaded: dict[str, tuple[int, int]] = {}
    fetched: dict[str, list[float]] = {}  # address -> [bytes done, bytes total, first seen, last seen]
    with bar("loading windows") as progress:
        def report(address: str, update) -> None:
            if update.fetch and update.total_bytes:
                now = time.monotonic()
                f = fetched.setdefault(address, [0, 0, now, now])
                f[0], f[1], f[3] = update.done_bytes, update.total_bytes, now
                progress(sum(f[0] for f in fetched.values()) >> 20, sum(f[1] for f in fetched.values()) >> 20,
                         "fetching weights " + ", ".join(_rate(a, *f) for a, f in fetched.items()))
            elif update.total_bytes:
                loaded[address] = (update.done_bytes, update.total_bytes)
                progress(sum(d for d, _ in loaded.values()) >> 20, sum(t for _, t in loaded.values()) >> 20,
                         "loading windows")

        try:
            nodes = ring.start(state["node"], sizes, state["token"], progress=report, members=members,
                               buffers=buffers, predicted=predicted[0] if predicted else None,
                               predicted_tpot_ms=predicted[1] if predicted else 0.0, batching=batching)
        except ring.RingError as exc:
            fail(f"{exc} (logs in {logs})" if logs else str(exc))
    for address, f in fetched.items():
        print(f"fetched {_rate(address, *f)}", file=sys.stderr)
    return nodes


def _rate(address: str, done: float, total: float, first: float, last: float) -> str:
    """ADDRESS 12/30 MiB at 80.0 MiB/s (the rate from the first progress update of that node)."""
    rate = done / (last - first) / 2**20 if last > first else 0.0
    return f"{address} {done / 2**20:.0f}/{total / 2**20:.0f} MiB" + (f" at {rate:.1f} MiB/s" if rate else "")


STATUS_COLUMNS = ("node", "role", "layers", "shard\nMiB", "RSS\nMiB", "disk\nMiB", "fetch\nMiB", "frames",
                  "active\nreqs", "mean\nbatch", "queue", "compute\ns", "stall\ns", "link\ns", "token\nms")
PLAN_COLUMNS = ("pred\nms", "meas\nms")  # once a plan's prediction is applied: per-token compute + stalls


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _status_table(head: str, rows: list[dict], caption: str = "") -> Table:
    """One row per node in ring order (red: lost, or it reports an error). Fits 100 columns; numbers are never cut."""
    cells = [[f"{r['name']}\n[dim]{r['address']}[/dim]" if r["name"] else r["address"],
              r["role"] if r["state"] == "up" else r["state"].upper() if r["state"] == "lost"
              else f"{r['role']}\n{r['state']}",
              "\n".join(f"[{a},{b})" for a, b in r["windows"]) or "-",
              f"{r['resident_bytes'] / 2**20:.0f}", f"{r['rss_bytes'] / 2**20:.0f}",
              f"{r['disk_read_bytes'] / 2**20:.0f}", f"{r['fetched_bytes'] / 2**20:.0f}", str(r["frames"]),
              str(r["active_requests"]), f"{r['mean_batch']:.1f}", str(r["queue_depth"]),
              f"{r['compute_s']:.2f}", f"{r['stall_s']:.2f}", f"{r['link_s']:.2f}", f"{r['last_token_ms']:.1f}"]
             for r in rows]
    columns, plan = STATUS_COLUMNS, ring_prediction(rows)
    if plan["predicted_tpot_ms"] is not None:  # the applied plan's prediction beside what the ring measures
        columns += PLAN_COLUMNS
        for r, row in zip(rows, cells):
            row += [_ms(r["predicted_ms"]), _ms(r["measured_ms"])]
        caption = (f"TPOT predicted {_ms(plan['predicted_tpot_ms'])} ms, measured {_ms(plan['measured_tpot_ms'])} ms "
                   f"(last token); pred / meas ms: per-token compute + stalls" + (f"\n{caption}" if caption else ""))
    table = Table(title=f"ring from {head}", caption=caption or None, box=box.SIMPLE_HEAD, show_edge=False,
                  collapse_padding=True)
    for j, col in enumerate(columns):
        if j < 3:  # text: the address folds only when the terminal is narrow
            width = max([len(r["address"]) for r in rows] + [len(r["name"]) for r in rows]) if j == 0 else 7
            table.add_column(col, overflow="fold", min_width=min(width, 21))
        else:
            table.add_column(col, justify="right", min_width=max([len(c[j]) for c in cells] + [4]))
    for r, row in zip(rows, cells):
        table.add_row(*row, style="red" if r["error"] or r["state"] == "lost" else None)
    return table


def _watch(state: dict, seconds: float, json_out: bool) -> None:
    """Re-walk the ring every `seconds` until Ctrl-C; a ring that cannot be walked is shown, not fatal
    (it may be re-planning)."""
    from rich.live import Live
    from rich.text import Text

    # Ctrl-C (SIGINT) is how a watch ends: make it raise here even where this process was started with SIGINT
    # ignored or blocked (bash starts a script's background jobs with it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    def snapshot():
        try:
            return [status_row(*member) for member in ring.status(state["node"], state["token"])], ""
        except ring.RingError as exc:
            return None, str(exc)

    try:
        if json_out:
            while True:
                rows, error = snapshot()
                print(json.dumps({"time": time.time(), "nodes": rows, **ring_prediction(rows)} if rows is not None
                                 else {"time": time.time(), "error": error}), flush=True)
                time.sleep(seconds)
        with Live(Text("walking the ring..."), auto_refresh=False) as live:
            while True:
                rows, error = snapshot()
                when = time.strftime("%H:%M:%S")
                live.update(_status_table(state["node"], rows, f"{when}, every {seconds:g} s; Ctrl-C stops")
                            if rows is not None else Text(f"{when}: {error}", style="red"), refresh=True)
                time.sleep(seconds)
    except KeyboardInterrupt:
        pass


async def _stream(state: dict, prompt: str, messages, kwargs: dict, echo: bool):
    tokens, text, done = [], [], None
    async with PrimaClient(state["node"], state["token"]) as client:  # PrimaError: the caller says it
        async for event in client.generate(prompt, messages=messages, **kwargs):
            if isinstance(event, Token):
                tokens.append(event.token_id)
                text.append(event.text)
                if echo:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            elif isinstance(event, Finished):
                done = event
    return tokens, "".join(text), done
