"""The README's layout table matches the tree: a row for every flows/ subpackage, and every path it names exists."""

from __future__ import annotations

import re

from flows import REPO


def _table_paths() -> list[str]:
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Layout"):].split("\n\n")[1]
    return [p for row in table.splitlines() if row.startswith("| `")
            for p in re.findall(r"`([^`]+)`", row.split("|")[1])]


def test_every_flows_subpackage_has_a_row() -> None:
    packages = sorted(f"flows/{d.name}/" for d in (REPO / "flows").iterdir() if (d / "__init__.py").is_file())
    assert packages, "flows/ has no subpackages"
    missing = [p for p in packages if p not in _table_paths()]
    assert not missing, f"README.md's layout table has no row for {missing}"


def test_every_path_in_the_table_exists() -> None:
    paths = _table_paths()
    assert "flows/" in paths and "tests/" in paths
    gone = [p for p in paths if not (REPO / p).exists()]
    assert not gone, f"README.md's layout table names paths that are not in the tree: {gone}"
