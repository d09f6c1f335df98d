"""One way for the CLIs to fail: a one-line `error: ...` on stderr and a non-zero exit, never a traceback.

`Typer` turns click's usage errors (a bad option, a number that is not one) and anything unexpected into that
line; `guarded` does it for the errors a user can cause, with the node's message and what to do.
"""

import functools
import os
import sys
from typing import NoReturn

import grpc
import typer
from typer.exceptions import TyperException

from prima_rpc.app.rpc_message import rpc_message
from prima_rpc.client import PrimaError
from prima_rpc.spec.manifest import StoreError


def fail(message: str, status: int = 2) -> NoReturn:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    raise typer.Exit(status)


def cut(finish_reason: str | None, max_tokens: int) -> None:
    """Say on stderr that an answer was cut at its token limit (finish_reason length), and how to get more."""
    if finish_reason == "length":
        print(f"\n[cut: the answer reached --max-tokens {max_tokens:,} (finish_reason: length); a larger "
              "--max-tokens lets it go on]", file=sys.stderr, flush=True)


def guarded(fn):
    """Turn the errors a user can cause into `fail` messages."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from prima_rpc.app.local_ring import LaunchError
        from prima_rpc.app.ring import RingError

        try:
            return fn(*args, **kwargs)
        except PrimaError as exc:
            fail(rpc_message(exc.code, exc.message))
        except grpc.RpcError as exc:
            fail(rpc_message(exc.code(), exc.details()))
        except (StoreError, RingError, LaunchError, ValueError, OSError) as exc:
            fail(str(exc) or type(exc).__name__)

    return wrapper


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
