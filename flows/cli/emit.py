"""Rows out of a command as a table, CSV or JSON (`--format`), readable when piped.

A table on a terminal is rich's; piped (a file, a CI log, `less`) it is rendered at its natural width
instead of being folded into 80 columns, so each row stays on one line. CSV and JSON carry the raw
values (numbers unformatted, None as empty / null) for scripts.
"""

from __future__ import annotations

import csv
import io
import json
import math
from enum import Enum
from functools import cache
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from rich.console import Console

PIPED_WIDTH = 10_000   # wide enough that no table folds: rich then sizes it to its content


class Format(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


# rich loads when a command first prints, never for `--help` (click prints that): consoles are made on
# first use and kept.
@cache
def term(stderr: bool = False, soft_wrap: bool = False) -> "Console":
    """A plain console on stdout or stderr."""
    from rich.console import Console
    return Console(stderr=stderr, soft_wrap=soft_wrap)


@cache
def console(stderr: bool = False) -> "Console":
    """A console that folds tables only on a real terminal."""
    from rich.console import Console
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=PIPED_WIDTH, soft_wrap=True)


def escape(text: str) -> str:
    """`text` with rich's markup escaped, for printing untrusted strings."""
    from rich.markup import escape as rich_escape
    return rich_escape(text)


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def emit(rows: Sequence[Mapping[str, Any]], fmt: Format, title: str = "",
         cells: Sequence[Sequence[str]] | None = None, header: Sequence[str] | None = None,
         right: Sequence[str] = ()) -> str:
    """The rows as text in `fmt`. A table shows `cells` under `header` (formatted for reading) when
    given, else the rows' own values; CSV and JSON always carry the raw rows."""
    if fmt == Format.json:
        return json.dumps([{k: _plain(v) for k, v in r.items()} for r in rows], indent=1, sort_keys=False) + "\n"
    if fmt == Format.csv:
        buf = io.StringIO()
        keys = list(rows[0]) if rows else list(header or [])
        w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if _plain(r.get(k)) is None else r.get(k) for k in keys})
        return buf.getvalue()
    header = list(header or (rows[0].keys() if rows else []))
    cells = cells if cells is not None else [["-" if r.get(k) is None else str(r.get(k)) for k in header] for r in rows]
    from rich.table import Table
    from rich.text import Text
    table = Table(title=title or None)
    for col in header:
        table.add_column(col, justify="right" if col in right else "left", overflow="fold")
    for c in cells:
        table.add_row(*(Text(x) for x in c))   # cells are text, never rich markup
    out = console()
    with out.capture() as cap:
        out.print(table)
    return cap.get()
