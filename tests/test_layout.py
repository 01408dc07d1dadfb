"""The project's layout: the README's table matches the tree (a row for every top-level folder and flows/
subpackage, every path it names exists), imports between the controller's rooms run one way only, no
module imports itself through others, and the payload (engine/, kernels/) never imports the controller."""

from __future__ import annotations

import ast
import re
import subprocess

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


def test_every_top_level_folder_has_a_row() -> None:
    """Each folder that holds a tracked file (hidden ones aside: tooling, not the project's layout)."""
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True).stdout
    folders = sorted({f"{p.split('/')[0]}/" for p in tracked.splitlines() if "/" in p and not p.startswith(".")})
    assert "engine/" in folders
    missing = [f for f in folders if f not in _table_paths()]
    assert not missing, f"README.md's layout table has no row for {missing}"


def test_every_path_in_the_table_exists() -> None:
    paths = _table_paths()
    assert "flows/" in paths and "tests/" in paths
    gone = [p for p in paths if not (REPO / p).exists()]
    assert not gone, f"README.md's layout table names paths that are not in the tree: {gone}"


# Each room may import only the rooms below it (cli, at the top, may import any).
BELOW = {
    "inventory": set(),
    "store": set(),
    "transport": {"inventory", "store"},
    "analysis": {"inventory", "store"},
    "notes": {"analysis", "inventory", "store"},
    "pipelines": {"analysis", "inventory", "notes", "store", "transport"},
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return parts[1]


def test_imports_run_one_way_between_the_rooms() -> None:
    wrong = []
    for f in sorted((REPO / "flows").rglob("*.py")):
        module = ".".join(f.relative_to(REPO).with_suffix("").parts)
        room = _room(module)
        if room not in BELOW:
            continue
        for node in ast.walk(ast.parse(f.read_text())):  # lazy imports inside functions count too
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flows"):
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "flows" else [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("flows.")]
            for name in names:
                target = _room(name)
                if target not in (None, room) and target in BELOW.keys() | {"cli"} and target not in BELOW[room]:
                    wrong.append(f"{module} imports {name}")
    assert not wrong, wrong


PACKAGES = ("flows", "engine", "kernels")


def _modules() -> dict[str, ast.Module]:
    """Every module of the project's packages by dotted name (a package by its own name), parsed."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            name = ".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            out[name] = ast.parse(f.read_text())
    return out


def _imported(tree: ast.Module, known: dict[str, ast.Module]) -> set[str]:
    """The project modules `tree` imports, lazy imports inside functions included, those under
    `if TYPE_CHECKING:` left out (they never run)."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in known}


def test_no_import_cycles_and_the_payload_never_imports_the_controller() -> None:
    known = _modules()
    graph = {m: _imported(tree, known) - {m} for m, tree in known.items()}
    upward = [f"{m} imports {t}" for m, ts in graph.items() if not m.startswith("flows")
              for t in ts if t.startswith("flows")]
    assert not upward, upward
    done: set[str] = set()

    def cycle_from(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        found = next((c for t in sorted(graph[m]) if (c := cycle_from(t, path + [m]))), None)
        done.add(m)
        return found

    cycles = [c for m in sorted(graph) if (c := cycle_from(m, []))]
    assert not cycles, " -> ".join(cycles[0])
