"""One way for the CLIs to fail: a one-line message on stderr and exit status 2, never a traceback."""

import functools
import sys
from typing import NoReturn

import grpc
import typer

from nodes.config import StoreError
from nodes.text import PromptError


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def guarded(fn):
    """Turn the errors a user can cause into `fail` messages."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (StoreError, PromptError, ValueError, OSError) as exc:
            fail(str(exc))
        except grpc.RpcError as exc:
            fail(f"{exc.code().name}: {exc.details()}")
        except KeyboardInterrupt:
            fail("interrupted")

    return wrapper
