"""One way for the CLIs to fail: a one-line `error: ...` on stderr and a non-zero exit, never a traceback.

`Typer` turns click's usage errors (a bad option, a number that is not one) and anything unexpected into that
line; `guarded` does it for the errors a user can cause, with the node's message and what to do. A ring command
that meets the ring mid-change (a retriable status while one of its nodes answers) runs again with back-off until
the ring settles or PRIMA_RETRY_S passes; then the line says so.
"""

import contextvars
import functools
import os
import sys
import time
from typing import NoReturn

import grpc
import typer
from typer.exceptions import TyperException

from prima_rpc.app.rpc_message import rpc_message
from prima_rpc.client import PrimaError
from prima_rpc.retry import RETRIABLE, pauses, settle_seconds
from prima_rpc.spec.manifest import StoreError

_retrying = contextvars.ContextVar("retrying", default=False)  # inside a ring command that may run again


class _TryAgain(Exception):
    """A retriable failure of a ring command: its one line, said only if the ring does not settle."""


def fail(message: str, status: int = 2, retriable: bool = False) -> NoReturn:
    """retriable: the ring may answer otherwise once it settles (a ring command runs again instead)."""
    message = " ".join(str(message).split())
    if retriable and _retrying.get():
        raise _TryAgain(message)
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(status)


def fail_rpc(code: grpc.StatusCode, details: str, address: str = "") -> NoReturn:
    fail(rpc_message(code, details, address), retriable=code in RETRIABLE)


def cut(finish_reason: str | None, max_tokens: int) -> None:
    """Say on stderr that an answer was cut at its token limit (finish_reason length), and how to get more."""
    if finish_reason == "length":
        print(f"\n[cut: the answer reached --max-tokens {max_tokens:,} (finish_reason: length); a larger "
              "--max-tokens lets it go on]", file=sys.stderr, flush=True)


def guarded(fn, retried: bool = False):
    """Turn the errors a user can cause into `fail` messages; retried: run the (ring) command again while the ring
    it meets changes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        target = _target(args, kwargs) if retried else None
        if target is None:
            return _run(fn, args, kwargs)
        return _retried(fn, args, kwargs, target)

    return wrapper


def _run(fn, args, kwargs):
    from prima_rpc.app.local_ring import LaunchError
    from prima_rpc.app.ring import RingError

    try:
        return fn(*args, **kwargs)
    except PrimaError as exc:  # partial: tokens were written already, another run would write them again
        fail(rpc_message(exc.code, exc.message), retriable=exc.code in RETRIABLE and not getattr(exc, "partial", 0))
    except grpc.RpcError as exc:
        fail_rpc(exc.code(), exc.details())
    except RingError as exc:
        fail(str(exc), retriable=exc.code in RETRIABLE)
    except (StoreError, LaunchError, ValueError, OSError) as exc:
        fail(str(exc) or type(exc).__name__)


def _retried(fn, args, kwargs, target):
    """fn run again after each retriable failure while a node of `target` answers, until the ring settles."""
    seconds, noted = settle_seconds(), False
    tries = pauses(seconds)
    while True:
        reset = _retrying.set(True)
        try:
            return _run(fn, args, kwargs)
        except _TryAgain as exc:
            why = str(exc)
        finally:
            _retrying.reset(reset)
        pause = next(tries, None) if _answers(target) else None
        if pause is None:
            fail(why + (f" (the ring did not settle within {seconds:.0f} s)" if noted else ""))
        if not noted:
            print(f"note: the ring is changing ({why[:160]}); trying again for up to {seconds:.0f} s "
                  "(PRIMA_RETRY_S)", file=sys.stderr, flush=True)
            noted = True
        time.sleep(pause)


def _target(args, kwargs):
    """The Target of a ring command (in its context: what has a node to ask), else None. By its fields, not its
    class: prima_rpc.app.cli_args imports this module."""
    for value in (*args, *kwargs.values()):
        obj = getattr(value, "obj", None)
        if isinstance(value, typer.Context) and hasattr(obj, "node") and hasattr(obj, "token"):
            return obj
    return None


def _answers(target) -> bool:
    """Whether any node the command was given answers: a ring there, mid-change (else nothing to wait for)."""
    from prima_rpc.control import Control, Deadlines

    for address in target.nodes or (target.node,):
        try:
            with Control(address, target.token, Deadlines(info=2.0)) as peer:
                peer.info()
            return True
        except grpc.RpcError:
            continue
    return False


class Typer(typer.Typer):
    """typer.Typer whose every failure is one line: usage errors, interrupts and bugs alike."""

    def __call__(self, args: list[str] | None = None, **kwargs):
        args = sys.argv[1:] if args is None else list(args)
        try:
            status = super().__call__(args or ["--help"], standalone_mode=False, **kwargs)
        except TyperException as exc:  # usage: no such option, not a number, missing argument
            ctx = getattr(exc, "ctx", None)
            command = f" {ctx.info_name}" if ctx is not None and ctx.parent is not None else ""
            print(f"error: {' '.join(exc.format_message().split())} (see prima-ctl{command} --help)", file=sys.stderr)
            status = exc.exit_code
        except (KeyboardInterrupt, typer.Abort):
            print("error: interrupted", file=sys.stderr)
            status = 130
        except Exception as exc:  # a bug: still one line, the traceback on request
            if os.environ.get("PRIMA_DEBUG"):
                raise
            print(f"error: unexpected {type(exc).__name__}: {' '.join(str(exc).split())} "
                  "(a bug; PRIMA_DEBUG=1 shows the traceback)", file=sys.stderr)
            status = 1
        sys.exit(status or 0)
