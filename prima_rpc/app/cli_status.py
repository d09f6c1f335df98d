"""`prima-ctl status`: every member of the ring with its state, once (a table or JSON) or refreshed (--watch)."""

import json
import signal
import time

import typer
from rich import box
from rich.table import Table

from prima_rpc.app import ring, tables
from prima_rpc.app.cli_args import Target
from prima_rpc.app.cli_errors import fail
from prima_rpc.app.status_rows import busy_words, ring_prediction, ring_replans, status_row
from prima_rpc.retry import RETRIABLE


def status(ctx: typer.Context,
           json_out: bool = typer.Option(False, "--json", help="print JSON (with --watch: one line per refresh)"),
           watch: float = typer.Option(None, "--watch", metavar="SECONDS",
                                       help="refresh every SECONDS until Ctrl-C")):
    """Every member in ring order with its state (up, lost, rejoining, fetching): role, windows, memory, timings."""
    target: Target = ctx.obj
    if watch is None:
        try:
            members = ring.status(target.node, target.token)
        except ring.RingError as exc:
            fail(str(exc), retriable=exc.code in RETRIABLE)
        rows, replans = [status_row(*member) for member in members], ring_replans(members)
        if json_out:
            print(json.dumps({"nodes": rows, **ring_prediction(rows), "replans": replans}, indent=1))
        else:
            tables.show(_status_table(target.node, rows, busy_words(rows, replans)))
        return
    if watch < 0.1:
        fail(f"--watch needs at least 0.1 seconds, got {watch}")
    _watch(target, watch, json_out)


STATUS_COLUMNS = ("node", "role", "layers", "shard\nMiB", "RSS\nMiB", "disk\nMiB", "fetch\nMiB", "frames",
                  "active\nreqs", "mean\nbatch", "queue", "compute\ns", "stall\ns", "link\ns", "token\nms")
PLAN_COLUMNS = ("pred\nms", "meas\nms")  # once a plan's prediction is applied: per-token compute + stalls


def _standby(row: dict) -> str:
    """The head's standby: `standby` once its copy of the head's units is complete, `standby...` while it fetches."""
    return ("\nstandby" if row["head_copy"] else "\nstandby...") if row["standby"] else ""


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _status_table(head: str, rows: list[dict], caption: str = "") -> Table:
    """One row per node in ring order (red: lost, or it reports an error). Fits 100 columns; numbers are never cut."""
    cells = [[f"{r['name']}\n[dim]{r['address']}[/dim]" if r["name"] else r["address"],
              (r["role"] if r["state"] == "up" else r["state"].upper() if r["state"] == "lost"
               else f"{r['role']}\n{r['state']}") + _standby(r),
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


def _watch(target: Target, seconds: float, json_out: bool) -> None:
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
            members = ring.status(target.node, target.token)
        except ring.RingError as exc:
            return None, [], str(exc)
        return [status_row(*member) for member in members], ring_replans(members), ""

    try:
        if json_out:
            while True:
                rows, replans, error = snapshot()
                print(json.dumps({"time": time.time(), "nodes": rows, **ring_prediction(rows), "replans": replans}
                                 if rows is not None else {"time": time.time(), "error": error}), flush=True)
                time.sleep(seconds)
        with Live(Text("walking the ring..."), auto_refresh=False) as live:
            while True:
                rows, replans, error = snapshot()
                when = time.strftime("%H:%M:%S")
                words = busy_words(rows, replans) if rows is not None else ""
                live.update(_status_table(target.node, rows, f"{when}, every {seconds:g} s; Ctrl-C stops"
                                          + (f"\n{words}" if words else ""))
                            if rows is not None else Text(f"{when}: {error}", style="red"), refresh=True)
                time.sleep(seconds)
    except KeyboardInterrupt:
        pass
