"""The projection's assumption records: typed where they are written and read, stored as JSON objects."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from engine.schema import SchemaError
from engine.table_files import provenance
from flows.analysis.assumptions import (BandEvidence, Comm, Kept, KernelModels, Other, ReferenceCeilings, StepModel,
                               TargetCeilings, TensorParallel, parse, record)
from flows.analysis.projection import assumptions, project
from flows.analysis.reference import load_reference, machine_of
from flows.inventory.hosts import Inventory
from flows.notes.publish import render_notes
from flows.store.store import Store
from support.runs import write_run


@pytest.fixture()
def projected(tmp_path: Path, inv: Inventory) -> tuple[Store, dict[str, pa.Table]]:
    write_run(tmp_path / "art" / "reference" / "h200")
    store = Store(str(tmp_path / "art"))
    ref = load_reference(store, inv, "h200")
    return store, project(ref.tables, ref.machine, machine_of(inv, "pro6000"))


def test_each_stored_record_reads_back_as_its_kind_and_writes_back_the_same_object(
        projected: tuple[Store, dict[str, pa.Table]]) -> None:
    _, tables = projected
    stored = provenance(tables["runs"])["assumptions"]
    typed = assumptions(tables)
    assert [type(a) for a in typed][:6] == [ReferenceCeilings, TargetCeilings, KernelModels, Kept, StepModel,
                                            TensorParallel]
    assert {Comm, BandEvidence} <= {type(a) for a in typed} and not any(isinstance(a, Other) for a in typed)
    assert [record(a) for a in typed] == stored
    # the runs rows' note carries the same records
    assert {json.dumps(json.loads(n)["assumptions"], sort_keys=True) for n in tables["runs"].column("note").to_pylist()} \
        == {json.dumps(stored, sort_keys=True)}


def test_a_kind_this_version_does_not_know_is_kept_as_stored() -> None:
    d = {"what": "a_later_kind", "figure": 1.5, "why": "text"}
    a = parse(d)
    assert a == Other(d) and record(a) == d


def test_a_known_kind_without_a_field_it_needs_is_refused_naming_both() -> None:
    with pytest.raises(SchemaError, match="comm: no interconnect, link_gbps"):
        parse({"what": "comm", "gpus": 8, "alpha_us": 5.0, "efficiency": 0.7, "efficiency_low": 0.6,
               "efficiency_high": 0.8, "calibrated": False, "allreduces_per_layer": 2})
    with pytest.raises(SchemaError, match=r"tensor_parallel\.rows: no how"):
        parse({"what": "tensor_parallel", "target_tp": 8, "gpus": 8, "rows": [{"from_tp": 1, "points": 3}]})


def test_a_stored_projection_whose_record_does_not_read_costs_its_own_page_only(
        projected: tuple[Store, dict[str, pa.Table]], inv: Inventory, tmp_path: Path) -> None:
    store, tables = projected
    prov = provenance(tables["runs"])
    prov["assumptions"] = [{k: v for k, v in a.items() if k != "interconnect"} for a in prov["assumptions"]]
    meta = json.dumps(prov, sort_keys=True).encode()
    broken = {name: t.replace_schema_metadata({**t.schema.metadata, b"kdbench.provenance": meta})
              for name, t in tables.items()}
    store.put_tables("pro6000", tables["runs"].column("run_id")[0].as_py(), broken)
    render_notes(store, inv, tmp_path / "docs")
    notes = tmp_path / "docs" / "notes"
    page = (notes / "pro6000.md").read_text()
    assert "its stored data could not be read: assumption record comm: no interconnect" in page
    assert "**Data: measured.**" in (notes / "h200.md").read_text()


def test_a_kind_this_version_does_not_know_is_worded_with_each_string_escaped_once() -> None:
    from flows.notes.sections.projected import assumption_text
    text = assumption_text(parse({"what": "a_later_kind", "why": "a|b <c>", "figures": [1, "x|y"]}))
    assert text == r"figures \[1, 'x\|y'\], what a_later_kind, why a\|b \<c\>"
