"""Inventory loading, validation messages and round-trip write-back."""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows import REPO
from flows.cli.app import app
from flows.inventory.files import activate, default_hosts_dir, load_host, load_inventory, retire, update_host
from flows.inventory.hosts import InventoryError
from flows.transport.connect import ProbeOutcome
from flows.transport.probe import probe


BOX = """\
# A test box.  Comments must survive write-back.
name: box
address: 127.0.0.1   # loopback only
port: 2222
user: bench
key_file: id_box
host_keys: []
spec: h200-sxm
gpus: 1
arch: sm_90
interconnect: none   # single GPU
python: python3
work_dir: kdbench
status: active
retired_reason: null
# trailing comment before notes
notes: keep me
"""


@pytest.fixture
def box_dir(inv_dir: Path) -> Path:
    """The copy of the shipped inventory plus one active host with a key file."""
    (inv_dir / "id_box").write_text("not really a key\n")
    (inv_dir / "box.yaml").write_text(BOX)
    return inv_dir


def test_shipped_inventory_loads() -> None:
    inv = load_inventory(REPO / "hosts")
    assert {"pro6000", "b300", "h200"} <= set(inv.hosts)
    assert {"h200-sxm", "rtx-pro-6000-server", "b300-sxm", "b200-sxm", "cpu-sandbox"} <= set(inv.specs)
    pro, b300, h200 = inv.hosts["pro6000"], inv.hosts["b300"], inv.hosts["h200"]
    assert (pro.status, pro.gpus, pro.arch, pro.interconnect) == ("active", 8, "sm_120", "pcie")
    assert (b300.status, b300.retired_reason, b300.gpus, b300.arch) == ("retired", "released", 8, "sm_103")
    assert (h200.status, h200.retired_reason, h200.arch) == ("retired", "released", "sm_90")
    assert all(h.is_placeholder() for h in inv.hosts.values())
    for spec in inv.specs.values():
        assert "bf16" in spec.tflops or spec.arch == "cpu"
        assert spec.sources, spec.name


def test_default_hosts_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KDBENCH_HOSTS", raising=False)
    assert default_hosts_dir() == REPO / "hosts"
    monkeypatch.setenv("KDBENCH_HOSTS", str(tmp_path))
    assert default_hosts_dir() == tmp_path


def test_placeholder_refused_before_any_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*a: object, **k: object) -> None:
        raise AssertionError("network touched")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    host = load_host(REPO / "hosts", "pro6000")
    with pytest.raises(InventoryError, match=r"pro6000\.yaml.*address.*placeholder.*edit .*pro6000\.yaml"):
        probe(host, REPO / "hosts")
    result = CliRunner().invoke(app, ["hosts", "trust", "pro6000", "--yes", "--hosts", str(REPO / "hosts")])
    assert result.exit_code == 2 and "placeholder" in result.output


BAD_CASES = {
    "unknown_spec": ("spec: h200-sxm", "spec: h900", "field 'spec': unknown spec 'h900'"),
    "bad_arch": ("arch: sm_90", "arch: sm_89", "field 'arch'"),
    "port_range": ("port: 2222", "port: 70000", "field 'port'"),
    "unsafe_name": None,
    "missing_key": ("key_file: id_box", "key_file: id_gone", "field 'key_file': file not found"),
    "malformed_yaml": ("gpus: 1", "gpus: [1", "malformed YAML"),
    "duplicate": None,
    "unknown_field": ("notes: keep me", "notes: keep me\ncolour: red", "field 'colour': unknown field"),
}


def _make_bad(d: Path, case: str) -> str:
    """Break the inventory in one way; returns the file whose name the message must carry."""
    if case == "unsafe_name":
        (d / "box.yaml").unlink()
        (d / "Bad Box.yaml").write_text(BOX.replace("name: box", "name: Bad Box"))
        return "Bad Box.yaml"
    if case == "duplicate":
        (d / "box2.yaml").write_text(BOX)  # name: box again
        return "box2.yaml"
    old, new, _ = BAD_CASES[case]
    (d / "box.yaml").write_text(BOX.replace(old, new))
    return "box.yaml"


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_inventory_one_clear_message_exit_2(box_dir: Path, case: str) -> None:
    fname = _make_bad(box_dir, case)
    result = CliRunner().invoke(app, ["hosts", "list", "--hosts", str(box_dir)])
    assert result.exit_code == 2, result.output
    msg = result.output
    assert "Traceback" not in msg
    assert fname in msg
    want = {"unsafe_name": "field 'name': must be a safe identifier", "duplicate": "duplicate name 'box'"}
    assert (want.get(case) or BAD_CASES[case][2]) in " ".join(msg.split()), msg  # type: ignore[index]


def test_write_back_keeps_comments_order_and_other_files(box_dir: Path) -> None:
    others = {p.name: p.read_bytes() for p in box_dir.glob("*.yaml") if p.name != "box.yaml"}
    before_keys = [line.split(":")[0] for line in BOX.splitlines() if line and not line.startswith("#")]
    h = retire(box_dir, "box", "host_key_changed", presented_host_key_fingerprint="SHA256:abc")
    assert (h.status, h.retired_reason, h.presented_host_key_fingerprint) == ("retired", "host_key_changed",
                                                                               "SHA256:abc")
    text = (box_dir / "box.yaml").read_text()
    for comment in ("# A test box.  Comments must survive write-back.", "# loopback only", "# single GPU",
                    "# trailing comment before notes"):
        assert comment in text
    keys = [line.split(":")[0] for line in text.splitlines() if line and not line.startswith(("#", " ", "-"))]
    assert keys[: len(before_keys)] == before_keys  # existing keys keep their order, new ones go after
    assert load_host(box_dir, "box").retired_at is not None
    assert {p.name: p.read_bytes() for p in box_dir.glob("*.yaml") if p.name != "box.yaml"} == others
    assert sorted(p.name for p in box_dir.glob("*.tmp")) == []
    h = activate(box_dir, "box")
    assert (h.status, h.retired_reason, h.retired_at) == ("active", None, None)


def test_update_rejects_bad_values_and_leaves_file(box_dir: Path) -> None:
    before = (box_dir / "box.yaml").read_bytes()
    with pytest.raises(InventoryError, match="box.yaml.*field 'port'"):
        update_host(box_dir, "box", port=0)
    with pytest.raises(InventoryError, match="field 'colour': unknown field"):
        update_host(box_dir, "box", colour="red")
    assert (box_dir / "box.yaml").read_bytes() == before


def _writer(d: str, field: str, n: int, barrier: "mp.synchronize.Barrier") -> None:
    barrier.wait()
    for i in range(n):
        update_host(Path(d), "box", **{field: (f"w{i}" if field == "notes" else i)})


def test_concurrent_writes_lose_nothing(box_dir: Path) -> None:
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    n = 25
    procs = [ctx.Process(target=_writer, args=(str(box_dir), f, n, barrier)) for f in ("notes", "unreachable_runs")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    h = load_host(box_dir, "box")
    assert (h.notes, h.unreachable_runs) == (f"w{n - 1}", n - 1)
    assert "# loopback only" in (box_dir / "box.yaml").read_text()


def _bomb(levels: int = 6, width: int = 6) -> str:
    """A billion-laughs document: `levels` anchors, each `width` aliases of the one before."""
    lines = ['a0: &a0 "lol"']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nnotes: *a{levels}\n"


def test_yaml_alias_bomb_gives_a_short_message(box_dir: Path) -> None:
    text = BOX.replace("notes: keep me\n", "") + _bomb()
    assert len(text.encode()) < 1024
    (box_dir / "box.yaml").write_text(text)
    result = CliRunner().invoke(app, ["hosts", "list", "--hosts", str(box_dir)])
    assert result.exit_code == 2 and "box.yaml" in result.output
    assert "anchors and aliases are not allowed" in " ".join(result.output.split())
    assert len(result.output) < 500


def test_long_bad_values_are_quoted_short(box_dir: Path) -> None:
    (box_dir / "box.yaml").write_text(BOX.replace("notes: keep me", "notes: [" + ", ".join(["x" * 50] * 200) + "]"))
    with pytest.raises(InventoryError, match="field 'notes'") as e:
        load_inventory(box_dir)
    assert len(str(e.value)) < 400


@pytest.mark.parametrize("field, value", [("work_dir", "-rf"), ("work_dir", "--help"), ("python", "-c"),
                                          ("work_dir", '"kd\\nbench"')])
def test_option_like_or_control_paths_are_refused(box_dir: Path, field: str, value: str) -> None:
    line = next(x for x in BOX.splitlines() if x.startswith(f"{field}:"))
    (box_dir / "box.yaml").write_text(BOX.replace(line, f"{field}: {value}"))
    result = CliRunner().invoke(app, ["hosts", "list", "--hosts", str(box_dir)])
    assert result.exit_code == 2 and "box.yaml" in result.output and f"field '{field}'" in result.output


def test_names_with_a_trailing_newline_are_refused(box_dir: Path) -> None:
    from flows.store.layout import StoreError, check_name
    from flows.transport.remote import remote_command

    with pytest.raises(InventoryError, match="not a safe identifier"):
        load_host(box_dir, "box\n")
    with pytest.raises(StoreError):
        check_name("host", "box\n")
    with pytest.raises(ValueError, match="bad environment variable name"):
        remote_command(["true"], timeout_s=1, env={"PATH\n": "x"})
    assert "cd -- -x &&" in remote_command(["true"], timeout_s=1, cwd="-x")


@pytest.mark.timeout(60)  # a guard, not a speed goal: the unbounded scan of a 64 KiB file took 412 s
@pytest.mark.parametrize("doc", ["notes: " + "[" * 1000 + "]" * 1000 + "\n", "[" * 65_000])
def test_deep_yaml_gives_a_short_message(box_dir: Path, doc: str) -> None:
    """N3: deep nesting escaped as a RecursionError (a 214 KB traceback from every command), and the
    anchor check's event scan was quadratic in the depth."""
    (box_dir / "box.yaml").write_text(BOX.replace("notes: keep me\n", "") + doc if doc.startswith("notes") else doc)
    result = CliRunner().invoke(app, ["hosts", "list", "--hosts", str(box_dir)])
    assert result.exit_code == 2 and "box.yaml" in result.output, result.output[-500:]
    assert "nested deeper than 16 levels" in " ".join(result.output.split())
    assert len(result.output) < 500 and "Traceback" not in result.output


def test_a_host_cannot_be_named_like_the_notes_index(box_dir: Path) -> None:
    """N15: the fleet index is docs/notes/README.md; a host `readme` would share its file on a
    case-insensitive checkout (upper case is no host name at all)."""
    (box_dir / "readme.yaml").write_text(BOX.replace("name: box", "name: readme"))
    with pytest.raises(InventoryError, match="readme.yaml: field 'name': 'readme' is the name of a page the notes index"):
        load_inventory(box_dir)


def test_a_probe_outcome_retires_a_host_with_its_plain_value(box_dir: Path) -> None:
    """The flow retires a host with the probe's outcome (a StrEnum): the YAML holds the plain word."""
    retire(box_dir, "box", ProbeOutcome.UNAUTHORIZED)
    text = (box_dir / "box.yaml").read_text()
    assert "retired_reason: unauthorized" in text and "ProbeOutcome" not in text
    assert load_host(box_dir, "box").retired_reason == "unauthorized"
