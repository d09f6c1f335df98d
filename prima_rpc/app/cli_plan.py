"""`prima-ctl plan`: solve the layer-to-device assignment, offline from a profiles file or for the live ring."""

import json
import sys
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from prima_rpc.app import tables
from prima_rpc.app.cli_args import Target
from prima_rpc.app.cli_errors import fail
from prima_rpc.request import DRAFT_TOKENS
from prima_rpc.spec.manifest import read_manifest


def plan(ctx: typer.Context,
         profiles: Path = typer.Option(None, help="device profiles JSON (offline what-if; default: the live ring)"),
         model: Path = typer.Option(None, help="store directory (with --profiles)"),
         strategy: str = typer.Option("halda", help="halda, halda-noselect, exo or even"),
         json_out: bool = typer.Option(False, "--json", help="print the plan as JSON"),
         out: Path = typer.Option(None, help="save the plan here (for `prima-ctl start --plan`)"),
         refresh: bool = typer.Option(False, help="re-measure the live nodes' profiles"),
         timeline: Path = typer.Option(None, help="draw one token's journey through the plan: out.png or out.svg"),
         concurrency: int = typer.Option(1, help="requests decoding at once: predict their throughput (and "
                                                 "with Halda, plan for it)"),
         speculate_accept: float = typer.Option(None, metavar="R", help="also predict TPOT with speculative "
                                                "decoding whose drafts are accepted at rate R (0-1)"),
         draft_tokens: int = typer.Option(None, metavar="N", help="tokens drafted per trip, with "
                                          "--speculate-accept (1-16; default: the head's)"),
         context: int = typer.Option(0, "--ctx", min=0, help="the context each request gets, in tokens: its KV "
                                     "is priced on every device, devices at --kv-dtype auto take the most precise "
                                     "KV dtype that holds it (0: the model's own, float)"),
         draft_ms: float = typer.Option(0.0, metavar="C", help="with --speculate-accept: the drafter's ms per "
                                        "drafted token on the head (0: free, e.g. prompt lookup)")):
    """Profile the devices, solve Halda, print the plan and its predicted TPOT."""
    if concurrency < 1:
        fail(f"--concurrency must be >= 1, got {concurrency}")
    speculation = speculation_option(speculate_accept, draft_tokens, draft_ms)
    if timeline is not None and timeline.suffix.lower() not in (".png", ".svg"):
        fail(f"--timeline must end in .png or .svg, got {timeline.name!r}")
    if profiles is not None and model is None:
        fail("--profiles needs --model DIR (a store or a manifest-only store)")
    result, title = _solve(ctx.obj, profiles, model, strategy, refresh, concurrency, speculation, context)
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
    if json_out:
        print(json.dumps(result))
    else:
        show(result)
    if "infeasible" in result:
        raise typer.Exit(1)
    if timeline is not None:
        from solver.timeline import render  # matplotlib: imported only when drawing

        render(result, timeline, title)
        print(f"timeline: {timeline}", file=sys.stderr if json_out else sys.stdout)


def _solve(target: Target, profiles: Path | None, model: Path | None, strategy: str, refresh: bool,
           concurrency: int, speculation: tuple[int, float, float] | None, context: int = 0) -> tuple[dict, str]:
    """(the plan, a title for its timeline): offline from --profiles and --model, else for the live ring."""
    if profiles is not None:
        from solver.strategies import plan_offline  # python-mip: only for commands that plan

        read_manifest(model)  # a clear error for a directory that is not a store
        manifest = json.loads((model / "manifest.json").read_text())
        result = plan_offline(profiles, manifest, strategy, concurrency=concurrency, speculation=speculation,
                              n_ctx=context * concurrency, choose_kv=bool(context))
        return result, f"{manifest.get('name', model.name)} on {profiles.stem}"
    from prima_rpc.app.cli_ring import reach
    from prima_rpc.app.live_plan import plan_live_shown

    reach(target)  # unreachable, or the token refused: said before profiling starts
    return plan_live_shown(target.node, target.token, strategy, refresh, concurrency, speculation, context), \
        f"the ring from {target.node}"


def speculation_option(rate: float | None, draft: int | None,
                       draft_ms: float = 0.0) -> tuple[int, float, float] | None:
    if rate is None:
        if draft is not None:
            fail("--draft-tokens needs --speculate-accept R")
        return None
    from nodes.generation.speculate import DEFAULT_DRAFT  # torch: only when planning with speculation

    draft = DEFAULT_DRAFT if draft is None else draft
    if not 0.0 <= rate <= 1.0:
        fail(f"--speculate-accept must be in [0, 1], got {rate}")
    if not DRAFT_TOKENS[0] <= draft <= DRAFT_TOKENS[1]:
        fail(f"--draft-tokens must be in [{DRAFT_TOKENS[0]}, {DRAFT_TOKENS[1]}], got {draft}")
    if not 0.0 <= draft_ms < 1e6:
        fail(f"--draft-ms must be >= 0, got {draft_ms}")
    return draft, rate, draft_ms / 1e3


def show(result: dict) -> None:
    console = Console()
    if "infeasible" in result:
        console.print(f"[red]infeasible[/red]: {result['infeasible']}")
        return
    table = Table(title=f"{result['strategy']} plan: k = {result['k']} rounds per token", box=box.SIMPLE_HEAD,
                  show_edge=False, collapse_padding=True)
    moe = "experts" in result  # a mixture: each node's expected expert reads, of the routed experts' bytes
    for col in ("device", "role", "window", "GPU\nlayers", "set", "memory\nGiB", "KV\nGiB", "stream\nbuffer",
                "predicted\nms",
                *(("experts read\nMiB/token",) if moe else ()), "layers"):
        table.add_column(col)
    for d in result["devices"]:
        experts = (f"{d['expert_bytes_per_token'] / 2**20:.1f} of {d['routed_expert_bytes_per_token'] / 2**20:.1f}",
                   ) if moe else ()
        table.add_row(d["name"], d["role"], str(d["window"]), str(d["gpu_layers"]), d["set"],
                      f"{d['memory_bytes'] / 2**30:.2f}",
                      f"{d['kv_bytes'] / 2**30:.2f} {d['kv_dtype']}" if "kv_bytes" in d else "-",
                      f"{d['buffer_layers']:.2f}" if d.get("buffer_layers") else "-", f"{d['predicted_ms']:.1f}",
                      *experts, " ".join(f"[{a},{b})" for a, b in d["layers"]) or "-")
    tables.show(table, console)
    if moe:
        console.print(f"experts: {result['experts']['hit_rate']}")
    if "ctx" in result:
        console.print(f"KV for {result['ctx']} positions a layer (all requests together)")
    console.print(f"predicted TPOT {result['predicted_tpot_ms']:.1f} ms{terms(result)}; "
                  f"solved in {result['solve_ms']:.1f} ms")
    if "concurrency" in result:
        console.print(throughput_line(result))
    if (s := result.get("speculation")) is not None:
        console.print(f"speculating {s['draft_tokens']} tokens a trip accepted at {s['accept_rate']:g}: "
                      f"{s['tokens_per_trip']:.2f} tokens a trip of {s['trip_ms']:.1f} ms, predicted TPOT "
                      f"{s['tpot_ms_speculative']:.1f} ms (best: {s['best_draft_tokens']} drafted, "
                      f"{s['tpot_ms_best']:.1f} ms); windows in flight: "
                      + (f"{s['depth']} of {s['inflight_draft_tokens']} drafts, predicted TPOT "
                         f"{s['tpot_ms_inflight']:.1f} ms" if s["inflight_draft_tokens"]
                         else "none pay, plain decoding"))


def throughput_line(r: dict) -> str:
    """The plan's throughput for its concurrency, e.g. '8 requests at once: 95.1 tokens/s in all, ...'."""
    who = "1 request" if r["concurrency"] == 1 else f"{r['concurrency']} requests at once"
    return (f"{who}: {r['aggregate_tps']:.1f} tokens/s in all, {r['tpot_ms_per_request']:.1f} ms per token each "
            f"(batches of up to {r['max_batch']}, {r['micro_batches']} in flight, {r['mode']} links); "
            f"bottleneck: {r['bottleneck']}")


def terms(result: dict) -> str:
    """What the predicted TPOT is made of (the cost model's terms_ms), e.g. ' = compute 12.0 + hops 3.1 ...'."""
    parts = [f"{name} {ms:.1f}" for name, ms in result.get("terms_ms", {}).items()
             if name in ("compute", "reads", "hops", "head") or ms > 0.05]
    return f" = {' + '.join(parts)}" if parts else ""
