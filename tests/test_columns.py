"""No column name is spelled as a string in the controller: flows/ reads rows through engine.rows' typed
rows (attributes) and names a column, where it must, through engine.rows.COLUMNS.

The rule (an AST scan): a string literal equal to a column of engine.schema's tables, used as a key (a
subscript, a dict key, the first argument of .get/.column/.pop/... ) or listed in a tuple, list or set of
column names only, is a column spelled by hand. EXCEPTIONS names each module the rule does not hold in yet,
or holds with a few names that are not table columns there, and why."""

from __future__ import annotations

import ast
from pathlib import Path

from engine.schema import SCHEMAS
from flows import REPO

COLUMNS = {n for s in SCHEMAS.values() for n in s.names}
KEY_CALLS = {"get", "pop", "setdefault", "column", "select", "drop_columns", "sort_by", "append_column",
             "set_column", "field", "get_field_index"}
ALL = None  # every column name is allowed there

_TERM = "the step model's term 'host' (flows.analysis.stepmodel.TERMS: host time), not the column"
_FACTS = "a host's probe facts (JSON the host answered, keyed by engine.schema.PROVENANCE_KEYS), not a table row"
_FACT_KEYS = frozenset({"python", "torch", "triton", "driver", "gpu_count"})
# module -> (the names allowed there, or ALL; why)
EXCEPTIONS: dict[str, tuple[frozenset[str] | None, str]] = {
    "flows/analysis/importer.py": (ALL, "parses outside CSV/JSON files whose headers are the column names (the "
                                   "import format of docs/running.md) into rows by name: not on typed rows yet"),
    "flows/analysis/projection.py": (frozenset({"host", "reference_run_id"}),
                                     f"{_TERM}; and a key of the projected runs rows' note (JSON), not the column"),
    "flows/analysis/whatif.py": (frozenset({"host"}), _TERM),
    "flows/analysis/backtest.py": (frozenset({"host"}), _TERM),
    "flows/analysis/stepmodel.py": (frozenset({"host", "tp", "context", "layers"}),
                                    f"{_TERM}; and the calibration shapes' axes (CAL_AXES: tp, tokens, context; "
                                    "FACTOR_AXES adds layers)"),
    "flows/analysis/bands.py": (frozenset({"tp"}), "the tp carry's name (and its backtest kind), not the column"),
    "flows/notes/sections/projected.py": (frozenset({"bytes"}), "a TpCarry.how word (how rows were re-sharded)"),
    "flows/cli/project.py": (frozenset({"tp", "concurrency", "context", "budget"}), "the command's option names"),
    "flows/pipelines/tasks.py": (frozenset({"points", "status"}),
                                 "a build.json kernel's status and the flow's own tally of a suite's points, not rows"),
    "flows/transport/probe.py": (_FACT_KEYS, _FACTS),
    "flows/cli/hosts.py": (_FACT_KEYS, _FACTS),
    "flows/pipelines/bench.py": (frozenset({"host", "run_id", "profile"}),
                                 "Prefect artifact tables and flow parameters, named like the columns"),
    "flows/pipelines/deployments.py": (frozenset({"host"}), "a Prefect flow parameter"),
    "flows/transport/deploy.py": (frozenset({"torch", "triton"}), "package names the host provides"),
    "flows/store/migrate.py": (frozenset({"host", "run_id"}), "lines of the layout-1 store index (JSON)"),
    "flows/store/store.py": (frozenset({"host"}), "the hive partition keys of the dataset view"),
}


def _strings(node: ast.AST) -> list[ast.Constant]:
    return [node] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []


def spelled(source: str) -> list[tuple[int, str]]:
    """(line, column name) of every column spelled as a string key in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        keys: list[ast.Constant] = []
        if isinstance(node, ast.Subscript):
            keys = _strings(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KEY_CALLS:
            keys = _strings(node.args[0]) if node.args else []
        elif isinstance(node, ast.Dict):
            keys = [c for k in node.keys if k is not None for c in _strings(k)]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 \
                and all(_strings(e) and e.value in COLUMNS for e in node.elts):  # type: ignore[attr-defined]
            keys = [e for e in node.elts if isinstance(e, ast.Constant)]
        out += [(k.lineno, k.value) for k in keys if k.value in COLUMNS]
    return sorted(out)


def test_the_rule_sees_a_column_spelled_as_a_key_and_not_one_read_as_an_attribute() -> None:
    assert spelled('t = r["time_us_p50"] + r.get("host_us", 0)\nk = {"M": 1}\nx = ("kernel", "impl")\n'
                   'y = ("kernel", "why")') == \
        [(1, "host_us"), (1, "time_us_p50"), (2, "M"), (3, "impl"), (3, "kernel")]
    assert spelled("t = r.time_us_p50\nc = tab.column(COLUMNS.reference_run_id)\nn = line('M')\n"
                   "s = ('kernels',)") == []


def _modules() -> list[Path]:
    return sorted((REPO / "flows").rglob("*.py"))


def test_no_flows_module_spells_a_column_name_as_a_string() -> None:
    wrong = []
    for f in _modules():
        rel = str(f.relative_to(REPO))
        allowed = EXCEPTIONS.get(rel, (frozenset(), ""))[0]
        if allowed is ALL:
            continue
        wrong += [f"{rel}:{line} {name!r}" for line, name in spelled(f.read_text()) if name not in allowed]
    assert not wrong, "columns spelled as strings (read typed rows' attributes, or engine.rows.COLUMNS):\n" + \
        "\n".join(wrong)


def test_every_exception_is_still_needed() -> None:
    stale = []
    for rel, (allowed, _) in EXCEPTIONS.items():
        names = {name for _, name in spelled((REPO / rel).read_text())}
        if not names or (allowed is not ALL and not allowed <= names):
            stale.append(f"{rel}: spells {sorted(names)}, allowed {'all' if allowed is ALL else sorted(allowed)}")
    assert not stale, "exceptions the code no longer needs (remove them):\n" + "\n".join(stale)
