"""The console automap prints its tables to."""

from __future__ import annotations

from rich.console import Console

#: Columns for tables when the output is not a terminal (piped or captured), where rich
#: would otherwise squeeze them to 80.
PIPED_WIDTH = 150


def table_console(console: Console | None = None) -> Console:
    """`console` when given; else the terminal's console, or one `PIPED_WIDTH` columns
    wide when the output is not a terminal."""
    if console is not None:
        return console
    c = Console()
    return c if c.is_terminal else Console(width=PIPED_WIDTH)
