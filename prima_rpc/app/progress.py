"""A rich progress bar on stderr that importers and loaders report into as progress(done, total)."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
