"""Print a rich table whole: never cut to the terminal's width (rich's default is 80 columns when piped)."""

from rich.console import Console
from rich.table import Table


def show(table: Table, console: Console | None = None) -> None:
    console = console or Console()
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    if natural > console.width:  # wider than the terminal: let it wrap rather than lose cells
        console = Console(width=natural, file=console.file, force_terminal=console.is_terminal)
    console.print(table)
