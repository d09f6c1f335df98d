"""Rich progress bars on stderr that long waits report into as progress(done, total), and their one-line summaries."""

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def bar(label: str) -> Iterator[Callable[[int, int], None]]:
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(label, total=None)

        def report(done: int, total: int, label: str | None = None) -> None:
            progress.update(task, completed=done, total=total, **({"description": label} if label else {}))

        yield report


def summary(line: str) -> None:
    """What a long wait made, its size and how long it took, e.g. 'profiled 3 devices in 70.2 s'."""
    print(line, file=sys.stderr, flush=True)


def mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


class LazyBar:
    """A bar that opens at its first report (most waits it watches are short and show none) and closes with
    end(), which prints the summary only if the bar was opened."""

    def __init__(self, label: str):
        self.label, self.started = label, time.monotonic()
        self._stack: ExitStack | None = None
        self._report: Callable[[int, int], None] | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._stack is None:
            self._stack = ExitStack()
            self._report = self._stack.enter_context(bar(self.label))
        self._report(done, total)

    def end(self, line: Callable[[float], str]) -> None:
        """Close the bar and print line(seconds since it was made), if it was shown."""
        if self._stack is not None:
            self._stack.close()
            self._stack = None
            summary(line(time.monotonic() - self.started))
