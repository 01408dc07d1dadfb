"""Step three of the notes: page views laid out by the jinja2 templates in flows/notes/templates/, and
each page's charts drawn beside it (layout only: every value is page text already)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Sequence

import jinja2

from flows.notes.sections.page import index_view, page_view
from flows.notes.views import HostView


@functools.cache
def _templates() -> jinja2.Environment:
    """The page templates shipped in flows/notes/templates/ (package data)."""
    return jinja2.Environment(loader=jinja2.PackageLoader("flows.notes", "templates"),
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                              keep_trailing_newline=True, autoescape=False)


def _render(template: str, **context: object) -> str:
    text = _templates().get_template(template).render(**context)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def render_host(view: HostView, notes_dir: Path) -> str:
    """The page's markdown; its charts are drawn under notes_dir/<host>/ on the way."""
    page, charts = page_view(view)
    for chart in charts:
        chart.draw(notes_dir / view.name)
    return _render("host.md.j2", page=page)


def render_index(views: Sequence[HostView]) -> str:
    return _render("index.md.j2", index=index_view(views))
