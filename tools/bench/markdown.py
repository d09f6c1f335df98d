"""Benchmarks print their results as Markdown tables, ready to paste into the README."""

from collections.abc import Iterable


def table(header: Iterable[str], rows: Iterable[Iterable], right: Iterable[int] = ()) -> str:
    """A Markdown table; `right`: indices of the columns aligned right (numbers)."""
    header, right = list(header), set(right)
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---:" if i in right else "---" for i in range(len(header))) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
