"""`prima-ctl start`, `generate` and `chat`: commands on a live ring, and what the other ring commands share."""

import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import typer

from prima_rpc.app import cli_args, ring
from prima_rpc.app.cli_args import Target
from prima_rpc.app.cli_errors import cut, fail, fail_rpc
from prima_rpc.app.progress import LazyBar, bar, mib, summary
from prima_rpc.app.rpc_message import rpc_message
from prima_rpc.client import Finished, Prefill, PrimaClient, PrimaError, Token
from prima_rpc.control import Control
from prima_rpc.request import GenerateRequest, Message, check_text
from prima_rpc.retry import RETRIABLE
from prima_rpc.v1 import prima_pb2 as pb


def start(ctx: typer.Context,
          windows: str = typer.Option(None, help="layers per node in ring order from --node: 8,8,14; 0 = relay"),
          plan: Path = typer.Option(None, help="a plan saved by `prima-ctl plan --out`")):
    """Assign windows to the ring (the --node becomes the head) and wait until every node has loaded.

    Without --windows or --plan: profile the live ring, solve Halda, and apply its plan."""
    target: Target = ctx.obj
    predicted, batching, kv = None, (0, 0), (None, 0)
    if windows is not None:
        sizes, members, buffers = cli_args.windows(windows), None, None
    reach(target)
    if windows is None:
        sizes, members, buffers, predicted, batching, kv = _plan_windows(target, plan)
    nodes = assign_windows(target, sizes, members, buffers, predicted=predicted, batching=batching, kv=kv)
    print(f"ring ready: {len(nodes)} nodes, head {target.node}")


def leave(ctx: typer.Context, node: str = typer.Argument(..., help="HOST:PORT of the member that leaves")):
    """Take a member out of the running ring: the head re-plans without it (requests in flight replay on the new
    ring, none fails), then stops it. The --node is any member; the head is found through it."""
    target: Target = ctx.obj
    node = cli_args.address(node, "NODE")
    info = reach(target)
    head = target.node if info.role == "head" else info.head
    if not head:
        fail(f"{target.node} is in no started ring (prima-ctl start assigns one)")
    try:
        with Control(head, target.token) as peer:
            left = peer.leave(node)
    except grpc.RpcError as exc:
        fail_rpc(exc.code(), exc.details(), head)
    print(f"{node} left the ring and stopped; the ring now: {' -> '.join(left.ring)}")


def generate(ctx: typer.Context, prompt: str = typer.Argument(...), max_tokens: int = typer.Option(128),
             temperature: float = typer.Option(None, help=cli_args.TEMPERATURE_HELP), top_k: int = typer.Option(0),
             top_p: float = typer.Option(1.0), seed: int = typer.Option(None),
             stop: list[str] = typer.Option([], help="stop string (repeatable)"),
             raw: bool = typer.Option(False), json_out: bool = typer.Option(False, "--json"),
             speculate: str = typer.Option("", help="off | ngram (prompt lookup) | draft; default: the head's"),
             draft_tokens: int = typer.Option(0, help="most tokens drafted per ring trip (1-16; 0: default)"),
             depth: int = typer.Option(0, help="speculative windows in flight round the ring (1-16; 1: one at a "
                                               "time; 0: the plan's or the head's choice)"),
             template_var: list[str] = typer.Option([], help=cli_args.TEMPLATE_VAR_HELP)):
    """Stream a completion from the ring's head (the --node)."""
    request = cli_args.request(prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, stop=stop, raw=raw, speculate=speculate,
                               draft_tokens=draft_tokens, depth=depth,
                               chat_template_kwargs=cli_args.template_vars(template_var))
    reach(ctx.obj)
    tokens, text, done = asyncio.run(stream(ctx.obj, request, echo=not json_out))
    if json_out:
        print(json.dumps({"tokens": tokens, "text": text, "prompt_tokens": done.prompt_tokens,
                          "finish_reason": done.finish_reason, "ttft_ms": done.ttft_ms, "tpot_ms": done.tpot_ms,
                          "drafted": done.drafted, "accepted": done.accepted, "max_tokens": done.max_tokens,
                          "depth": done.depth, "trips": done.trips}))
        capped(request, done)
    else:
        print()


def chat(ctx: typer.Context, max_tokens: int = typer.Option(256),
         temperature: float = typer.Option(None, help=cli_args.TEMPERATURE_HELP),
         template_var: list[str] = typer.Option([], help=cli_args.TEMPLATE_VAR_HELP)):
    """An interactive chat with the ring (empty line or Ctrl-D ends it; Ctrl-C stops an answer).

    A failed turn prints its error and the chat goes on; the exit status is 1 if any turn failed."""
    history = cli_args.request(max_tokens=max_tokens, temperature=temperature,  # the chat so far
                               chat_template_kwargs=cli_args.template_vars(template_var))
    reach(ctx.obj)
    _say_if_plain(ctx.obj)
    failed = False
    while (line := _read_line()) is not None:
        try:
            check_text(line, "your message")
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            failed = True
            continue
        asked = replace(history, messages=history.messages + (Message("user", line),))
        try:
            _, text, _ = asyncio.run(stream(ctx.obj, asked, echo=True, prefix="model> "))
            history = replace(asked, messages=asked.messages + (Message("assistant", text),))
            print()
        except PrimaError as exc:  # the turn is dropped from the history; the chat goes on
            print(flush=True)
            print(f"error: {rpc_message(exc.code, exc.message)}", file=sys.stderr, flush=True)
            failed = True
        except KeyboardInterrupt:
            print(" [stopped]", flush=True)
    if failed:
        raise typer.Exit(1)


PLAIN_NOTE = ("note: this model has no chat template: it is a base model, so it does not answer questions; it "
              "continues the text you write (plain completion), each turn after the text so far")


def _say_if_plain(target: Target) -> None:
    """Say on stderr when the chat is plain completion (a model without a chat template)."""
    try:
        plain = ring.plain_chat(target.node, target.token)
    except ring.RingError:
        return  # the chat's first turn says what is wrong with the node
    if plain:
        print(PLAIN_NOTE, file=sys.stderr, flush=True)


def _read_line() -> str | None:
    """The user's next message; None at an empty line or the end of input."""
    try:
        line = input("you> ").strip()
    except EOFError:
        return None
    except UnicodeDecodeError:  # a UTF-8 terminal got other bytes
        line = "\udcff"  # refused by the caller, as under a C locale (surrogate-escaped bytes)
    return line or None


def reach(target: Target) -> pb.NodeInfo:
    """The --node's Info, or a one-line error: unreachable, or the token refused."""
    try:
        with Control(target.node, target.token) as peer:
            return peer.info()
    except grpc.RpcError as exc:
        fail_rpc(exc.code(), exc.details(), target.node)


async def stream(target: Target, request: GenerateRequest, echo: bool,
                 prefix: str = "") -> tuple[list[int], str, Finished]:
    """(token ids, text, Finished) of one request to the --node; echo: write `prefix` and the text as it comes,
    after a bar of a long prompt's prefill (its tokens through the ring, chunk by chunk) and its summary."""
    tokens, text, done, total = [], [], None, 0
    prefill = LazyBar("reading the prompt (tokens)")
    try:
        # every --node it was given, the one that answered first first: a lost head's stream resumes on the new one
        addresses = [target.node, *(a for a in target.nodes if a != target.node)]
        async with PrimaClient(addresses, target.token) as client:  # PrimaError: the caller says it
            async for event in client.stream(request, prefill=echo):
                if isinstance(event, Prefill):
                    prefill(event.done, total := event.total)
                    continue
                if echo and not tokens and done is None:  # the first answer: the prompt is read
                    prefill.end(lambda s: f"read the prompt: {total:,} tokens in {s:.1f} s")
                    sys.stdout.write(prefix)
                if isinstance(event, Token):
                    tokens.append(event.token_id)
                    text.append(event.text)
                    if echo:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                elif isinstance(event, Finished):
                    done = event
    except PrimaError as exc:
        exc.partial = bool(tokens)  # a run again would write them twice: the error is final (cli_errors)
        raise
    finally:
        prefill.end(lambda s: f"stopped reading the prompt after {s:.1f} s")
    if echo and done is not None and not capped(request, done):
        cut(done.finish_reason, request.max_tokens)
    return tokens, "".join(text), done


def capped(request: GenerateRequest, done: Finished) -> bool:
    """Say when the head cut max_tokens to what the context leaves (and the answer ran into that limit)."""
    was = 0 < done.max_tokens < request.max_tokens
    if was:
        print(f"\nnote: max_tokens {request.max_tokens:,} was capped to {done.max_tokens:,}, what the model's "
              f"context leaves after the {done.prompt_tokens:,}-token prompt"
              + (" (finish_reason: length)" if done.finish_reason == "length" else ""), file=sys.stderr, flush=True)
    return was


def _plan_windows(target: Target, plan_file: Path | None):
    """Windows in ring order from a saved or freshly solved plan, which devices stay in the ring
    (removed ones are routed around; relays stay), their stream buffers in layers (0: default), and the plan's
    prediction: (each device's per-token compute and stalls, turn_ms, and the TPOT, in ms) or None, its batching,
    and its KV: (each device's KV dtype, the context per request) or (None, 0) where it names none."""
    if plan_file is not None:
        try:
            result = json.loads(plan_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            fail(f"cannot read plan {plan_file}: {exc}")
    else:
        from prima_rpc.app.live_plan import plan_live_shown

        result = plan_live_shown(target.node, target.token, "halda", refresh=False)
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
        kv = ([str(d["kv_dtype"]) for d in devices], int(result["ctx"])) \
            if all("kv_dtype" in d for d in devices) and "ctx" in result else (None, 0)
        return ([int(d["window"]) for d in devices], [d.get("role") != "removed" for d in devices],
                [float(d.get("buffer_layers", 0.0)) for d in devices], predicted, batching, kv)
    except (KeyError, TypeError, ValueError, AttributeError):
        fail("the plan has no valid devices list")


def assign_windows(target: Target, sizes: list[int], members: list[bool] | None = None,
                   buffers: list[float] | None = None, logs: Path | None = None,
                   predicted: tuple[list[float], float] | None = None, batching: tuple[int, int] = (0, 0),
                   kv: tuple[list[str] | None, int] = (None, 0)):
    """ring.start from the --node with a progress bar of loading (and fetching) windows; a one-line error."""
    loaded: dict[str, tuple[int, int]] = {}
    fetched: dict[str, list[float]] = {}  # address -> [bytes done, bytes total, first seen, last seen]
    started = time.monotonic()
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
            nodes = ring.start(target.node, sizes, target.token, progress=report, members=members,
                               buffers=buffers, predicted=predicted[0] if predicted else None,
                               predicted_tpot_ms=predicted[1] if predicted else 0.0, batching=batching,
                               kv_dtypes=kv[0], ctx=kv[1])
        except ring.RingError as exc:
            fail(f"{exc} (logs in {logs})" if logs else str(exc), retriable=exc.code in RETRIABLE)
    for address, f in fetched.items():
        print(f"fetched {_rate(address, *f)}", file=sys.stderr)
    summary(f"loaded {sum(1 for w in sizes if w)} windows of {sum(sizes)} layers "
            f"({mib(sum(t for _, t in loaded.values()))}) in {time.monotonic() - started:.1f} s")
    return nodes


def _rate(address: str, done: float, total: float, first: float, last: float) -> str:
    """ADDRESS 12/30 MiB at 80.0 MiB/s (the rate from the first progress update of that node)."""
    rate = done / (last - first) / 2**20 if last > first else 0.0
    return f"{address} {done / 2**20:.0f}/{total / 2**20:.0f} MiB" + (f" at {rate:.1f} MiB/s" if rate else "")
