"""Reading a rendered notes page back: one section, the rows of its first table."""

from __future__ import annotations


def section(page: str, title: str) -> str:
    """The text of one `## title` section (up to the next `## `)."""
    start = page.index(f"## {title}\n")
    end = page.find("\n## ", start + 1)
    return page[start:end if end >= 0 else len(page)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first markdown table in text."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
